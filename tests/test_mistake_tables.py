"""Every mistake in a check module's tables is planted by a test (tests/named.py says how a
test module declares its plants), every plant names a mistake of a table, and the count of
planted mistakes per chapter is printed (``pytest -s tests/test_mistake_tables.py``)."""

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import spike_course.checks
from spike_course.checks._common import tables

from named import mistake_of

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = {path.stem: path.read_text() for path in sorted((ROOT / "solutions").glob("*.ipynb"))}


def checks_in(module) -> list[str]:
    """The check_* functions ``module`` defines (not those it imports)."""
    return [name for name, value in vars(module).items()
            if name.startswith("check_") and getattr(value, "__module__", "") == module.__name__]


def check_modules():
    """Each module of spike_course.checks that defines a check_* function, by short name."""
    modules = {info.name: importlib.import_module(f"spike_course.checks.{info.name}")
               for info in pkgutil.iter_modules(spike_course.checks.__path__)}
    return {name: module for name, module in modules.items() if checks_in(module)}


def chapters_of(module) -> list[str]:
    """The solution notebooks that call one of ``module``'s checks."""
    return [stem for stem, text in SOLUTIONS.items()
            if any(re.search(rf"\b{check}\(", text) for check in checks_in(module))]


def plants():
    """{check module name: the mistake names its test modules plant}."""
    planted = {}
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        if path.name == Path(__file__).name or "CHECK_MODULE" not in path.read_text():
            continue
        test_module = importlib.import_module(path.stem)
        name = test_module.CHECK_MODULE.__name__.rsplit(".", 1)[1]
        planted.setdefault(name, set()).update(mistake_of(key) for key in test_module.PLANTS)
    return planted


# Read when the tests are collected: importing a test module reads the course's files with git.
MODULES, PLANTED = check_modules(), plants()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_mistake_of_a_table_is_planted_and_every_plant_is_in_a_table(name):
    table, planted = set(tables(MODULES[name])), PLANTED.get(name, set())
    assert all(mistake_of(mistake) == mistake for mistake in table), "a mistake's name ends in (...): a plant's how"
    assert not table - planted, f"{name}: no test plants {sorted(table - planted)}"
    assert not planted - table, f"{name}: plants of mistakes in no table {sorted(planted - table)}"


def test_the_planted_mistakes_per_chapter_are_counted(capsys):
    modules, planted = MODULES, PLANTED
    lines = []
    for name, module in sorted(modules.items(), key=lambda item: chapters_of(item[1])):
        where = ", ".join(stem[:2] for stem in chapters_of(module)) or "no chapter"
        count = len(tables(module))
        lines.append(f"chapter {where} ({name}): " + (f"{count} mistakes in tables, {len(planted.get(name, ()))} "
                                                       "planted" if count else "no table of mistakes yet"))
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert all(chapters_of(module) for module in modules.values()), lines
