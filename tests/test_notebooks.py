"""Committed notebooks are clean and follow the course conventions."""

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
ALL = sorted(p for folder in ("notebooks", "solutions", "exercises") for p in (ROOT / folder).glob("*.ipynb"))
IDS = [f"{p.parent.name}/{p.stem}" for p in ALL]


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(notebook.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; run nbstripout on it"


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_first_code_cell_sets_up_the_chapter(path):
    notebook = nbformat.read(path, as_version=4)
    first = next(c for c in notebook.cells if c.cell_type == "code")
    assert re.search(rf'setup\((\w+ := )?"{path.stem}"', first.source), (
        f"{path.name}: the first code cell should call spike_course.notebook.setup(\"{path.stem}\")")


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_worker_scripts_go_to_the_chapter_folder(path):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        match = re.match(r"%%writefile\s+(\S+)", cell.source)
        if match:
            assert match.group(1).startswith(f"workers/{path.stem}/"), match.group(1)


def test_every_chapter_has_its_lecture_and_matching_exercise():
    lectures = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    solutions = {p.stem for p in (ROOT / "solutions").glob("*.ipynb")}
    assert "00_welcome_and_setup" in lectures
    assert solutions <= lectures, f"solutions without a lecture: {solutions - lectures}"
    assert {p.stem for p in (ROOT / "exercises").glob("*.ipynb")} == solutions
