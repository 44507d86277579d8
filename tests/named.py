"""A check's verdict asserted by the mistake's name (``CheckFailed.mistake``), not by the
words of its message (which must not hand over a line of any solution), and the convention by
which a test module says what it plants.

A test module that plants the mistakes of a check module's tables names that module in
``CHECK_MODULE`` and keeps its plants in ``PLANTS``, a dict keyed by mistake name: each key
is planted and asserted with :func:`names`. tests/test_mistake_tables.py fails for a mistake
in a table that no ``PLANTS`` holds."""

import contextlib
import re

import pytest

from spike_course.checks import CheckFailed
from spike_course.course import conventions

import course_files

# A message names the mistake and points to the hints: it never hands over a line of the answer
# (issue 40). The solutions' answer lines, long enough to be code and not a phrase a message may
# share with them (a name, "return total").
QUOTABLE = 30
SOLUTION_LINES = {line.strip() for path in sorted((course_files.ROOT / "solutions").glob("*.ipynb"))
                  for cell in course_files.notebook(path).cells if cell.cell_type == "code"
                  for region in conventions.regions(cell.source)
                  for line in region.splitlines() if len(line.strip()) >= QUOTABLE
                  and not line.strip().startswith(("#", '"""', "'''"))}


@contextlib.contextmanager
def names(mistake, says: str | None = None):
    """The block must fail its check naming ``mistake`` (None: a failure no table lists, which
    the check words itself; a tuple: one of these, where a plant shows as either depending on
    where the check's drill struck); ``says`` (a regular expression) is what the message must
    also hold, where its words are what is tested (a figure, a rank, a message not yet in a table)."""
    with pytest.raises(CheckFailed) as failure:
        yield failure
    allowed = mistake if isinstance(mistake, tuple) else (mistake,)
    assert failure.value.mistake in allowed, f"named {failure.value.mistake!r}, not {mistake!r}:\n{failure.value}"
    quoted = [line for line in SOLUTION_LINES if line in str(failure.value)]
    assert not quoted, f"the message hands over the solution's line {quoted[0]!r}:\n{failure.value}"
    if says is not None:
        assert re.search(says, str(failure.value)), f"the message does not say {says!r}:\n{failure.value}"


def mistake_of(plant: str) -> str:
    """The mistake's name in a ``PLANTS`` key: "bf16 compute (autocast)" plants "bf16 compute"
    (so a mistake's own name never ends in parentheses)."""
    return re.sub(r" \([^()]*\)$", "", plant)
