"""The one shape of every check's verdict: a table of known mistakes (``Mistake``), the first
that an answer's readings show named (``name_the_first``) as a ``CheckFailed`` that carries the
mistake's name. The exercises' checks and the rehearsal's findings name their mistakes in it;
it imports nothing of the course, so that any module may use it."""

from __future__ import annotations

from typing import Callable, NamedTuple


class CheckFailed(AssertionError):
    """The exercise's answer is not right yet; the message says what is likely wrong, and
    ``mistake`` is the name of the mistake in the check's table that it saw (None where the
    check names no known mistake: a crash, a blank, a value it cannot explain). Tests assert
    the name, so that rewording a message breaks no test."""

    def __init__(self, message: str = "", mistake: str | None = None):
        super().__init__(message)
        self.mistake = mistake

    def _render_traceback_(self) -> list[str]:
        """What a notebook shows (IPython asks the exception): the message alone, as a learner
        reads it. A traceback would add the check's own code, which holds the hints for the
        other mistakes it names."""
        return [f"\x1b[0;31mCheckFailed\x1b[0m: {self}"]


class Mistake(NamedTuple):
    """A known mistake in a check's table: its name (a test plants each), how the check's
    readings show it, and what the learner is told (a text, or made from the readings)."""
    name: str
    seen: Callable[..., bool]
    message: Callable[..., str] | str

    def text(self, *readings) -> str:
        return self.message(*readings) if callable(self.message) else self.message

    def failure(self, *readings, before: str = "", after: str = "") -> CheckFailed:
        """The CheckFailed that names this mistake, its message made from ``readings``."""
        return CheckFailed(before + self.text(*readings) + after, mistake=self.name)


def name_the_first(mistakes, *readings, before: str = "", after: Callable[[], str] | None = None) -> None:
    """Fail with the message of the first of ``mistakes`` that ``readings`` show (after
    ``before``, and followed by what ``after()`` says); return if none does."""
    for mistake in mistakes:
        if mistake.seen(*readings):
            raise mistake.failure(*readings, before=before, after=after() if after else "")


def tables(module) -> dict[str, Mistake]:
    """Every mistake in the tables of a check module (module-level Mistakes, and tuples or
    lists of them), by name: what the tests must plant, each at least once."""
    found = {}
    for value in vars(module).values():
        listed = isinstance(value, (tuple, list)) and not isinstance(value, Mistake)
        for mistake in value if listed else [value]:
            if isinstance(mistake, Mistake):
                assert found.setdefault(mistake.name, mistake) is mistake, f"two mistakes named {mistake.name!r}"
    return found
