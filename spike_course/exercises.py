"""Generate ``exercises/`` from ``solutions/``, and tell when the two have drifted.

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

The markers, and grading with check cells restored from the source, are nbgrader's
conventions (https://nbgrader.readthedocs.io); this module keeps just those two.
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


def execute_cells(path, timeout: int = 600, notebook=None) -> list[dict]:
    """Run an exercise notebook to the end (errors do not stop it) and say how each code
    cell went: {"index", "tags", "source", "error"} with error None or "Name: message".

    ``notebook`` runs in place of the file's content, in the file's folder. CI runs the
    blank exercises through this; ``spike-course grade`` runs a learner's.
    """
    from .headless import run_notebook

    notebook = run_notebook(path, timeout, allow_errors=True, notebook=notebook).notebook
    cells = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        cells.append({"index": index, "tags": cell.metadata.get("tags", []), "source": cell.source,
                      "error": f"{errors[0].ename}: {errors[0].evalue}" if errors else None})
    return cells


def restore_checks(notebook, exercise) -> list[str]:
    """Put the check cells of ``exercise`` back into a learner's ``notebook`` (matched by
    cell id), so an edited check cannot pass a wrong answer. Returns the sources of the
    check cells the learner's notebook no longer has."""
    originals = {cell.id: cell for cell in exercise.cells if CHECK_TAG in cell.metadata.get("tags", [])}
    for cell in notebook.cells:
        original = originals.pop(cell.get("id"), None)
        if original is not None:
            cell.cell_type, cell.source = "code", original.source
            cell.metadata["tags"] = list(original.metadata["tags"])
            cell.setdefault("outputs", [])
            cell.setdefault("execution_count", None)
    return [cell.source for cell in originals.values()]


def grade(path, timeout: int = 600, solutions_dir=None) -> list[dict]:
    """The check cells of a learner's exercise notebook, each with its error or None.

    As nbgrader does, the grader does not trust the notebook's own check cells: they are
    put back as ``solutions/`` generates them before anything runs, and a check cell the
    learner deleted counts as failed. ``solutions_dir`` defaults to the ``solutions/``
    beside the notebook's folder.
    """
    path = Path(path)
    solution = Path(solutions_dir or path.resolve().parent.parent / "solutions") / path.name
    if not solution.is_file():
        raise FileNotFoundError(
            f"no {solution} to take the check cells from: grade a notebook named as in "
            f"solutions/ (for example exercises/03_data_parallel.ipynb) from the course folder")
    notebook = nbformat.read(path, as_version=4)
    missing = restore_checks(notebook, make_exercise(nbformat.read(solution, as_version=4), solution.name))
    checks = [cell for cell in execute_cells(path, timeout, notebook) if CHECK_TAG in cell["tags"]]
    return checks + [{"index": None, "tags": [CHECK_TAG], "source": source,
                      "error": f"MissingCheck: this check cell was deleted; copy it back from {solution.name}"}
                     for source in missing]
