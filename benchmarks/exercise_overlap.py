"""How much of each exercise's answer is already on the page? The rubric's first measure.

    python benchmarks/exercise_overlap.py

For every solution region of ``solutions/``: its non-trivial lines (not blank, not a comment,
not a lone bracket, ``pass`` or ``return``), with spaces normalised, and the share of them that
appear as a line of the page the learner has in front of them: the chapter's lecture, the
earlier lectures, and the exercise notebook itself outside its answer regions. A second
column normalises names too (every identifier becomes ``_``), which finds a lecture's line
retyped with other variable names. The course's rubric asks for at most 20 %; this prints
the numbers (it does not fail), so an exercise's rewrite can be measured before and after.
"""

from __future__ import annotations

import io
import keyword
import re
import tokenize
from pathlib import Path

import nbformat

from spike_course.course.conventions import regions
from spike_course.course.exercises import make_exercise

ROOT = Path(__file__).resolve().parents[1]
TRIVIAL = re.compile(r"^(#.*|[\])}]+,?|pass|return|else:|try:|finally:|\"\"\".*)?$")


def spaces(line: str) -> str:
    return " ".join(line.split())


def names(line: str) -> str:
    """The line with every identifier (not keywords) replaced by _, strings by "s"."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return spaces(line)
    out = []
    for token in tokens:
        if token.type == tokenize.NAME and not keyword.iskeyword(token.string):
            out.append("_")
        elif token.type == tokenize.STRING:
            out.append('"s"')
        elif token.string.strip():
            out.append(token.string)
    return " ".join(out)


def lines_of(text: str) -> list[str]:
    return [spaces(line) for line in text.splitlines() if not TRIVIAL.match(spaces(line))]


def page(stem: str, exercise) -> str:
    lectures = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    before = [p for p in lectures if p.stem <= stem]
    text = [c.source for p in before for c in nbformat.read(p, as_version=4).cells]
    return "\n".join(text + [c.source for c in exercise.cells])


def overlap(path: Path) -> list[tuple[int, int, float, float]]:
    solution = nbformat.read(path, as_version=4)
    on_page = lines_of(page(path.stem, make_exercise(solution, path.name)))
    exact, renamed = set(on_page), {names(line) for line in on_page}
    rows = []
    for index, cell in enumerate(solution.cells):
        for region in (regions(cell.source) if cell.cell_type == "code" else ()):
            answer = lines_of(region)
            if answer:
                rows.append((index, len(answer), sum(line in exact for line in answer) / len(answer),
                             sum(names(line) in renamed for line in answer) / len(answer)))
    return rows


def main() -> None:
    print(f"{'exercise':40s} {'cell':>4s} {'lines':>5s} {'on page':>8s} {'renamed':>8s}")
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        for index, count, share, renamed in overlap(path):
            print(f"{path.stem:40s} {index:4d} {count:5d} {share:8.0%} {renamed:8.0%}")


if __name__ == "__main__":
    main()
