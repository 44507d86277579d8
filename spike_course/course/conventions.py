"""The course notebooks' conventions, read in one place: by exercises, grading, the export
of workers, the capstone check's preflight and every test.

- A solution region sits between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` lines
  (nbgrader's markers); its BEGIN line may say where the exercise starts,
  ``### BEGIN SOLUTION (starts as workers/NN_topic/single.py)``.
- In the exercise each region is the stub: ``# YOUR CODE HERE`` and a line that raises
  ``NotImplementedError`` (indented like the BEGIN line), followed, for a region that starts
  as a file, by that file's text as the notebook writes it.
- A ``%%writefile PATH`` cell writes PATH: its text is the rest of the cell.
- Tags: ``check`` (a cell that checks an answer), ``uses-solution`` (a cell that needs the
  answer to run), ``raises-exception`` (nbval lets it fail: the exercise gives them all).

Standard library only: every notebook imports the checks, and the capstone's preflight
imports this module.
"""

from __future__ import annotations

import re

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CHECK_TAG, USES_TAG, RAISES_TAG = "check", "uses-solution", "raises-exception"
STUB = 'raise NotImplementedError("exercise: replace this line with your code")'
STARTS_AS_KEY = "spike_course_starts_as"  # in a blank cell's metadata: the given script it starts as
_BEGIN_LINE = re.compile(r"^(\s*)" + re.escape(BEGIN) + r"(?: \(starts as (\S+)\))?\s*$")
_WRITEFILE = re.compile(r"\A%%writefile\s+(\S+)[ \t]*\n")
# A whole region: its indent (group 1), its text (group 2), from the BEGIN line to the END line's end.
_REGION = re.compile(r"^([ \t]*)### BEGIN SOLUTION[^\n]*\n(.*?)^[ \t]*### END SOLUTION[^\n]*(?:\n|\Z)", re.S | re.M)
_MARKER_LINE = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[^\n]*(\n|\Z)", re.M)


def written_files(notebook) -> dict:
    """{path: text} of the notebook's ``%%writefile`` cells, as the course wrote them."""
    return {path: cell.source.split("\n", 1)[1] for cell in notebook.cells if (path := writes(cell))}


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


def region_matches(source: str) -> list[re.Match]:
    """Each solution region of a cell's (or a written file's) source, in order: ``group(0)`` the
    region with its marker lines, ``group(1)`` the BEGIN line's indent, ``group(2)`` its text."""
    return list(_REGION.finditer(source))


def regions(source: str) -> list[str]:
    """The text inside each solution region of a cell's (or a written file's) source."""
    return [match.group(2) for match in region_matches(source)]


def outside_regions(source: str) -> str:
    """``source`` without its solution regions: the code the page gives around the answers."""
    return _REGION.sub("", source)


def without_markers(source: str) -> str:
    """``source`` with its solution markers' lines taken out and the solution kept: the file
    as the course runs it and exports it for the cluster."""
    return _MARKER_LINE.sub("", source)


def written_file(notebook, path: str, markers: bool = True) -> str:
    """The text that the notebook's ``%%writefile path`` cell writes (with its solution
    markers, or without them); a clear error when no cell writes it."""
    found = written_files(notebook)
    if path not in found:
        raise KeyError(f"no %%writefile cell of this notebook writes {path} (it writes {sorted(found)})")
    return found[path] if markers else without_markers(found[path])


def writes(cell) -> str | None:
    """The path a ``%%writefile`` code cell writes, or None for any other cell."""
    match = _WRITEFILE.match(cell.source) if cell.cell_type == "code" else None
    return match.group(1) if match else None


# The two lines a solution region becomes in the exercise (blank_source).
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


def stub_lines(source: str) -> list[int]:
    """The line numbers (from 1) where ``source`` still holds an exercise's stub: a blank."""
    return [number for number, line in enumerate(source.splitlines(), 1) if line.strip() == STUB]


def is_whole_script(blank_cell) -> bool:
    """True for an exercise cell whose stub is followed by a given script the learner changes."""
    return STARTS_AS_KEY in blank_cell.get("metadata", {})
