"""Planting a mistake in a copy of a solution (the file a solution notebook's ``%%writefile``
cell writes, ``conventions.written_file``): lines of its solution region changed, a region
replaced, every variant of a function in one launch."""

import re
import textwrap

from spike_course.course import conventions
from spike_course.course.conventions import BEGIN, region_matches

import course_files


def replace_region(source: str, number: int, code: str, regions: int | None = None) -> str:
    """``source`` with its solution region ``number`` (counted from 0, marker lines included)
    replaced by ``code``; ``regions``: how many the solution has, asserted."""
    found = region_matches(source)
    assert regions is None or len(found) == regions, \
        f"the solution has {len(found)} solution regions, not {regions}: update this test"
    match = found[number]
    return source[:match.start()] + code + source[match.end():]


def planted(source: str, *changes) -> str:
    """``source`` with each (old, new) of ``changes`` made once, after its first solution marker."""
    head, region = source.split(BEGIN, 1)
    for old, new in changes:
        assert old in region, f"the solution's region no longer contains {old!r}: update this test"
        region = region.replace(old, new, 1)
    return head + BEGIN + region


def _function_span(source: str, function: str) -> tuple[int, int]:
    """Where the top-level ``def function(`` of ``source`` starts and ends (the first line
    after it that is not indented or blank)."""
    start = source.index(f"\ndef {function}(") + 1
    following = re.search(r"\n(?=\S)", source[start:])
    return start, start + following.start() + 1 if following else len(source)


def one_launch_for_all(sources: dict, function: str, loop_from: str, loop_to: str = "runtime.teardown()",
                       before_each: str = "") -> str:
    """One worker that runs every variant in ``sources`` (a name -> a whole worker source, each
    differing from the first only inside its top-level ``function``) in one launch: the lines
    from ``loop_from`` up to ``loop_to`` run once per variant with that variant's ``function``,
    and what they report arrives under the variant's name (``reports[rank][name]``).
    ``before_each`` (a line) puts back what a variant may have changed for the next one.
    A launch is what a plant costs; the plants that neither hang nor crash share one."""
    base = next(iter(sources.values()))
    start, end = _function_span(base, function)
    definitions = []
    for number, (name, source) in enumerate(sources.items()):
        begin, finish = _function_span(source, function)
        assert source[:begin] + source[finish:] == base[:start] + base[end:], \
            f"the variant {name!r} changes more than {function}()"
        definitions.append(source[begin:finish].replace(f"def {function}(", f"def {function}_{number}(", 1))
    body_start = base.index(loop_from, end)
    body_end = base.index(loop_to, body_start)
    table = ", ".join(f"{name!r}: {function}_{number}" for number, name in enumerate(sources))
    loop = ("_report = runtime.report\n"
            f"for _variant, {function} in {{{table}}}.items():\n"
            "    runtime.report = lambda _variant=_variant, **values: _report(**{_variant: values})\n"
            + (f"    {before_each}\n" if before_each else "")
            + textwrap.indent(base[body_start:body_end].rstrip() + "\n", "    ")
            + "runtime.report = _report\n")
    return base[:start] + "".join(definitions) + base[end:body_start] + loop + base[body_end:]


def answer_function(source: str, name: str, old: str = "", new: str = "", namespace: dict | None = None):
    """The function ``name`` that a solution cell's ``source`` defines, with ``old`` replaced by
    ``new`` once, run with ``namespace`` (the names the notebook imported for it)."""
    assert old in source, f"the solution no longer contains {old!r}: update this test"
    namespace = dict(namespace or {})
    exec(source.replace(old, new, 1), namespace)  # noqa: S102 - the course's own solution
    return namespace[name]


def solution_cell(stem: str, function: str) -> str:
    """The source of the solution cell of solutions/``stem``.ipynb that defines ``function`` (a
    function or a class, with its solution region), for :func:`answer_function`."""
    notebook = course_files.notebook(course_files.ROOT / "solutions" / f"{stem}.ipynb")
    return next(cell.source for cell in notebook.cells if cell.cell_type == "code"
                and conventions.has_solution(cell)
                and (f"def {function}(" in cell.source or f"class {function}(" in cell.source))
