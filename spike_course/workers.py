"""Export every chapter's worker scripts for the cluster, without running a notebook.

A chapter writes its workers with ``%%writefile workers/NN_topic/name.py`` cells, so
they exist only after the notebook ran. ``spike-course workers --out DIR`` reads those
cells from the lectures and the solutions and writes ``DIR/NN_topic/name.py``, each
starting with the command that runs it, e.g. the docstring line
``torchrun --standalone --nproc-per-node=2 03_data_parallel/train.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

SOURCES = ("notebooks", "solutions")
_WRITEFILE = re.compile(r"^%%writefile\s+workers/(\S+)\s*\n")
_SOLUTION_MARKER = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*\n", re.M)


def worker_cells(notebook) -> dict[str, str]:
    """{"NN_topic/name.py": source} for every Python worker a notebook writes."""
    found = {}
    for cell in notebook.cells:
        match = _WRITEFILE.match(cell.source) if cell.cell_type == "code" else None
        if match and match.group(1).endswith(".py"):
            found[match.group(1)] = _SOLUTION_MARKER.sub("", cell.source[match.end():])
    return found


def _ranks(notebook_source: str, name: str) -> int:
    """The nproc the chapter launches ``name`` with (a literal or a NAME = literal), else 2."""
    call = re.search(rf'launch\([^)]*{re.escape(name)}["\'][^)]*?nproc=(\w+)', notebook_source)
    if not call:
        return 2
    value = call.group(1)
    if value.isdigit():
        return int(value)
    constant = re.search(rf"^{value}\s*=\s*(\d+)\b", notebook_source, re.M)
    return int(constant.group(1)) if constant else 2


def run_line(relative: str, source: str, siblings: dict[str, str], nproc: int) -> str:
    """How this file is started on a node: torchrun, plain python, or not at all (a module)."""
    stem = Path(relative).stem
    if any(re.search(rf"^\s*(from {stem} import|import {stem}\b)", other, re.M)
           for path, other in siblings.items() if path != relative):
        return f"A module that the other workers of {Path(relative).parent} import; not run on its own."
    if "torch.distributed" not in source and "spike_course" not in source:
        return f"python {relative}    (one process: it uses no torch.distributed)"
    if "mp.spawn(" in source or "torch.multiprocessing.spawn(" in source:
        return f"python {relative}    (it starts its own processes with torch.multiprocessing.spawn)"
    options = "  [options: --help]" if "add_argument(" in source else ""
    return f"torchrun --standalone --nproc-per-node={nproc} {relative}{options}"


def _with_first_line(line: str, source: str) -> str:
    """Put ``line`` first in the module docstring (adding a docstring if there is none)."""
    for quotes in ('"""', "'''"):
        if source.startswith(quotes):
            return f"{quotes}{line}\n\n{source[len(quotes):]}"
    return f'"""{line}"""\n{source}'


def collect(root) -> dict[str, str]:
    """{"NN_topic/name.py": text with its run line} for every chapter, lectures and solutions."""
    root = Path(root)
    collected = {}
    for folder in SOURCES:
        for notebook_path in sorted((root / folder).glob("[0-9][0-9]_*.ipynb")):
            notebook = nbformat.read(notebook_path, as_version=4)
            cells = worker_cells(notebook)
            notebook_source = "\n".join(c.source for c in notebook.cells)
            for relative, source in cells.items():
                if relative in collected:
                    raise ValueError(f"two notebooks write workers/{relative}: give one of them "
                                     f"another name (second one: {notebook_path})")
                nproc = _ranks(notebook_source, Path(relative).name)
                line = run_line(relative, source, cells, nproc)
                collected[relative] = _with_first_line(line, source)
    return collected


def export(root, out) -> list[Path]:
    """Write every worker under ``out``; return the paths written."""
    out = Path(out)
    written = []
    for relative, text in collect(root).items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
