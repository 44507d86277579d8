"""Planting a mistake in a copy of a solution: the file a solution notebook's ``%%writefile``
cell writes, with its solution markers kept, and that file with lines of its solution
region changed."""

BEGIN = "### BEGIN SOLUTION"


def written_file(notebook, relative: str) -> str:
    """The source of ``workers/<relative>`` as the notebook's %%writefile cell writes it,
    solution markers included (so that ``exercises.blank_source`` can blank it)."""
    head = f"%%writefile workers/{relative}"
    return next(c.source for c in notebook.cells if c.source.startswith(head)).split("\n", 1)[1]


def planted(source: str, *changes) -> str:
    """``source`` with each (old, new) of ``changes`` made once, after its first solution marker."""
    head, region = source.split(BEGIN)
    for old, new in changes:
        assert old in region, f"the solution's region no longer contains {old!r}: update this test"
        region = region.replace(old, new, 1)
    return head + BEGIN + region
