"""Grade exercise notebooks: run them headless and report each check cell.

CI runs the blank exercises through :func:`execute_cells` (every check must fail on the
blank); ``spike-course grade`` runs a learner's through :func:`grade`, which first puts
the check cells back as ``solutions/`` generates them, as nbgrader does
(https://nbgrader.readthedocs.io), so an edited check cannot pass a wrong answer.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

from .exercises import CHECK_TAG, make_exercise


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


def check_name(source: str) -> str:
    """What a check cell checks, for a report: the last ``checks.check_...`` function it
    calls (a cell may first call a helper such as ``checks.launch_reports``)."""
    called = re.findall(r"\bchecks\.(\w+)\(", source)
    return ([name for name in called if name.startswith("check_")] or called or ["the check cell"])[-1]


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
