"""Grade exercise notebooks: run them headless and report each check cell.

CI runs the blank exercises through :func:`execute_cells` (every check must fail on the
blank); ``spike-course grade`` runs a learner's through :func:`grade`, which does not run
the learner's notebook at all: as nbgrader does with its locked cells
(https://nbgrader.readthedocs.io), it rebuilds the notebook from ``solutions/`` and takes
only the learner's answer regions (:func:`rebuild`). A check redefined in an added cell,
an edited reference or check cell, or an answer that borrows the checks' own code or
reads ``solutions/`` cannot pass: each is reported as a failure that says what it was.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

from .answer_scan import COURSE_NAMES, imported_names, misuses
from .conventions import CHECK_TAG, writes, answers_in, has_solution, is_whole_script, lines_as_read, pieces_around
from .exercises import make_exercise

# What an added cell must not do: redefine a check, or what the checks raise and print.
_TAMPERING = re.compile(r"\bchecks\s*\.\s*\w+\s*=(?!=)|setattr\s*\(\s*checks|def\s+check_\w+"
                        r"|\bcheck_\w+\s*=(?!=)|CheckFailed\s*=(?!=)|\bpassed\s*=(?!=)|sys\.modules")


# An error the guards raise in the kernel grade runs: the audit hook, or the checks' own.
_REFUSED = re.compile(r"\w+: (BorrowedAnswer|Tampering):")


def execute_cells(path, timeout: int = 600, notebook=None) -> list[dict]:
    """Run an exercise notebook to the end (errors do not stop it) and say how each code
    cell went: {"index", "tags", "source", "error"} with error None or "Name: message".

    ``notebook`` runs in place of the file's content, in the file's folder. CI runs the
    blank exercises through this; ``spike-course grade`` runs a learner's.
    """
    from ..lab.headless import run_notebook

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


def rebuild(learner, solution, name: str = "") -> tuple:
    """The notebook grade runs, and what is wrong with the learner's: the exercise's cells
    with each blank filled from the learner's cell of the same id, and nothing else.

    Returns (notebook, problems): problems are {"id", "error"} for a reference or check cell
    the learner edited, code changed around an answer, an answer that borrows the checks'
    code or reads solutions/, and an added cell that touches the checks. Added cells are
    never run; an edited reference cell runs as the course wrote it.
    """
    exercise = make_exercise(solution, name)
    theirs = {cell.get("id"): cell for cell in learner.cells if cell.cell_type == "code"}
    # What the course's cells import: an answer that rebinds or patches one is reported.
    imported = set(COURSE_NAMES).union(
        *(imported_names(cell.source) for cell in exercise.cells if cell.cell_type == "code"))
    problems = []
    for index, cell in enumerate(exercise.cells):
        mine = theirs.pop(cell.get("id"), None)
        if cell.cell_type != "code" or mine is None:
            continue
        if not has_solution(solution.cells[index]):
            if lines_as_read(mine.source) != lines_as_read(cell.source):
                kind = "check" if CHECK_TAG in cell.metadata.get("tags", []) else "reference"
                problems.append({"id": cell.id, "error": f"EditedCell: this {kind} cell differs from the "
                                 "exercise's; it is graded as the course wrote it, so the edit cannot help"})
            continue
        whole_script = is_whole_script(cell)
        answers = answers_in(cell.source, mine.source, whole_script)
        if answers is None:
            problems.append({"id": cell.id, "error": "EditedCell: the code around the answer (outside "
                             "# YOUR CODE HERE) was changed; only the answer is graded: put the rest back "
                             "as the exercise has it"})
            continue
        pieces = pieces_around(cell.source, whole_script)
        cell.source = pieces[0] + "".join(a + p for a, p in zip(answers, pieces[1:]))
        in_kernel = not (whole_script or writes(cell))
        for misuse in misuses(cell.source, _answer_lines(pieces, answers), imported, in_kernel):
            problems.append({"id": cell.id, "error": misuse.message()})
    for cell in theirs.values():
        if _TAMPERING.search(cell.source):
            problems.append({"id": cell.get("id"), "error": "AddedCell: a cell you added touches the "
                             "checks; grading never runs added cells, and a check redefined there "
                             "counts as a failure"})
    return exercise, problems


def _refuse_reading(folder: Path) -> str:
    """A first cell for the kernel grade runs: an audit hook (which nothing can remove once
    added, https://peps.python.org/pep-0578/) that refuses to open any file of ``folder``,
    however the answer spelled its path. What it calls is bound when it is added, before
    any answer runs."""
    return (
        "def _grading_guard(folder):\n"
        "    import os, sys\n"
        "    def refuse(event, args, folder=os.path.realpath(folder), real=os.path.realpath,\n"
        "               decode=os.fsdecode, sep=os.sep, PathLike=os.PathLike):\n"
        "        if event == 'open' and isinstance(args[0], (str, bytes, PathLike)):\n"
        "            path = real(decode(args[0]))\n"
        "            if path == folder or path.startswith(folder + sep):\n"
        "                raise PermissionError('BorrowedAnswer: ' + path + ' is one of the course\\'s solutions:'\n"
        "                                      ' grading refuses to open it')\n"
        "    sys.addaudithook(refuse)\n"
        f"_grading_guard({str(folder)!r})\n"
        "del _grading_guard")


def _answer_lines(pieces, answers) -> list[tuple[int, int]]:
    """The first and last line (from 1) of each answer in the rebuilt cell."""
    lines, text = [], pieces[0]
    for answer, piece in zip(answers, pieces[1:]):
        first = text.count("\n") + 1
        lines.append((first, first + answer.rstrip("\n").count("\n")))
        text += answer + piece
    return lines


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
    learner = nbformat.read(path, as_version=4)
    notebook, problems = rebuild(learner, nbformat.read(solution, as_version=4), solution.name)
    notebook.cells.insert(0, nbformat.v4.new_code_cell(_refuse_reading(solution.parent), id="grading-guard"))
    position = {cell.get("id"): index for index, cell in enumerate(learner.cells)}
    ran = [dict(cell, index=position.get(notebook.cells[cell["index"]].get("id")))
           for cell in execute_cells(path, timeout, notebook)]
    # A check cell's outcome, and any cell where the kernel's guards refused what an answer did.
    checks = [cell for cell in ran if CHECK_TAG in cell["tags"] or _REFUSED.match(cell["error"] or "")]
    for check in checks:
        if check["index"] is None:
            check["error"] = f"MissingCheck: this check cell was deleted; copy it back from {solution.name}"
    return checks + [{"index": position.get(problem["id"]), "tags": [], "source": "", "name": "grading",
                      "error": problem["error"]} for problem in problems]
