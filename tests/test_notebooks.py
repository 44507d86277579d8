"""Committed notebooks are clean and follow the course conventions."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spike_course.course import conventions

import course_files

ROOT = Path(__file__).resolve().parents[1]
# As git holds them: a learner's saved outputs and answers in the working tree are not the course's.
ALL = [p for folder in ("notebooks", "solutions", "exercises") for p in course_files.tracked(folder)]
IDS = [f"{p.parent.name}/{p.stem}" for p in ALL]


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_committed_without_outputs(path):
    notebook = course_files.notebook(path)
    dirty = [i for i, c in enumerate(notebook.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, (f"{path.name} as git holds it: cells {dirty} carry outputs; commit it without "
                       f"them: nbstripout {path.relative_to(ROOT)}, then git add")


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_first_code_cell_sets_up_the_chapter(path):
    notebook = course_files.notebook(path)
    first = next(c for c in notebook.cells if c.cell_type == "code")
    assert re.search(rf'setup\((\w+ := )?"{path.stem}"', first.source), (
        f"{path.name}: the first code cell should call spike_course.notebook.setup(\"{path.stem}\")")


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_worker_scripts_go_to_the_chapter_folder(path):
    notebook = course_files.notebook(path)
    for cell in notebook.cells:
        written = conventions.writes(cell)
        if written:
            assert written.startswith(f"workers/{path.stem}/"), written


@pytest.mark.parametrize("path", course_files.tracked("notebooks", "[0-9][0-9]_*.ipynb"),
                         ids=lambda p: p.stem)
def test_numbered_sections_carry_their_chapters_number(path):
    """From chapter 12 on a lecture numbers its sections "12.1", "12.2", ... (the edition's
    contents and a learner's "see 14.2" then name one place); no lecture borrows another's number."""
    chapter = int(path.stem[:2])
    headings = [line for cell in course_files.notebook(path).cells if cell.cell_type == "markdown"
                for line in cell.source.splitlines() if re.match(r"## \d", line)]
    for heading in headings:
        numbered = re.match(r"## (\d+)\.(\d+) ", heading)
        assert numbered is None or int(numbered.group(1)) == chapter, heading
        assert chapter < 12 or numbered, f"{path.name}: {heading!r} should read '## {chapter}.k ...'"


def test_every_chapter_has_its_lecture_and_matching_exercise():
    lectures = {p.stem for p in course_files.tracked("notebooks", "*.ipynb")}
    solutions = {p.stem for p in course_files.tracked("solutions", "*.ipynb")}
    assert "00_welcome_and_setup" in lectures
    assert solutions <= lectures, f"solutions without a lecture: {solutions - lectures}"
    assert {p.stem for p in course_files.tracked("exercises", "*.ipynb")} == solutions


@pytest.mark.processes
def test_what_a_notebook_imports_leaves_the_document_libraries_out():
    """The kernel imports spike_course's checks, viz, widgets...; none of them may pull in
    nbformat (about 2 s here: its schema validator compiles format grammars at import),
    nbclient or jsonschema. Those are for the commands that read notebooks, not for a
    chapter, whose every run would pay for them (the capstone check once did, via the
    worker exporter)."""
    imports = set()
    for path in ALL:
        for cell in course_files.notebook(path).cells:
            if cell.cell_type != "code" or cell.source.startswith("%%"):
                continue
            source = "\n".join(l for l in cell.source.splitlines() if not l.lstrip().startswith(("%", "!")))
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ImportFrom):
                    modules = [node.module or ""]
                elif isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                else:
                    continue
                if any(module.startswith("spike_course") for module in modules):
                    imports.add(ast.unparse(node))
    assert "from spike_course import checks, notebook, viz" in imports  # the search finds them
    program = "\n".join(sorted(imports)) + (
        "\nimport sys\nprint(sorted({m.split('.')[0] for m in sys.modules} & {'nbformat', 'nbclient', 'jsonschema'}))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", f"a chapter's imports load {done.stdout.strip()}"
