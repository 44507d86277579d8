"""A check's verdict asserted by the mistake's name (``CheckFailed.mistake``), not by the
words of its message, and the convention by which a test module says what it plants.

A test module that plants the mistakes of a check module's tables names that module in
``CHECK_MODULE`` and keeps its plants in ``PLANTS``, a dict keyed by mistake name: each key
is planted and asserted with :func:`names`. tests/test_mistake_tables.py fails for a mistake
in a table that no ``PLANTS`` holds."""

import contextlib
import re

import pytest

from spike_course.checks import CheckFailed


@contextlib.contextmanager
def names(mistake: str | None, says: str | None = None):
    """The block must fail its check naming ``mistake`` (None: a failure no table lists, which
    the check words itself); ``says`` (a regular expression) is what the message must also
    hold, where its words are what is tested (a figure, a rank, a message not yet in a table)."""
    with pytest.raises(CheckFailed) as failure:
        yield failure
    assert failure.value.mistake == mistake, f"named {failure.value.mistake!r}, not {mistake!r}:\n{failure.value}"
    if says is not None:
        assert re.search(says, str(failure.value)), f"the message does not say {says!r}:\n{failure.value}"


def mistake_of(plant: str) -> str:
    """The mistake's name in a ``PLANTS`` key: "bf16 compute (autocast)" plants "bf16 compute"
    (so a mistake's own name never ends in parentheses)."""
    return re.sub(r" \([^()]*\)$", "", plant)
