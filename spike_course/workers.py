"""Export every chapter's worker scripts for the cluster, without running a notebook.

A chapter writes its workers with ``%%writefile workers/NN_topic/name.py`` cells, so
they exist only after the notebook ran. ``spike-course workers --out DIR`` reads those
cells from the lectures and the solutions (or, with ``--from exercises``, from a learner's
own notebooks) and writes ``DIR/NN_topic/name.py`` as the cell has it, and
``DIR/README.md`` on how to run them on a GPU node. Every worker's docstring starts with
the command that runs it, as nanoGPT's scripts do (``torchrun --standalone
--nproc-per-node=2 03_data_parallel/train.py``; a module's names the script that imports
it): the author writes it, nothing guesses it.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

from . import exercises

SOURCES = ("notebooks", "solutions")
_SOLUTION_MARKER = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[^\n]*(\n|\Z)", re.M)


def worker_cells(notebook) -> dict[str, str]:
    """{"NN_topic/name.py": source} for every Python worker a notebook writes."""
    return {path.removeprefix("workers/"): _SOLUTION_MARKER.sub("", text)
            for path, text in exercises.written_files(notebook).items()
            if path.startswith("workers/") and path.endswith(".py")}


MODULE = " imports this module"  # in a module's run line: the script that runs it


def run_line(relative: str, source: str) -> str:
    """The first line of the worker's docstring, which says how it runs on a node: a torchrun
    or python command naming the worker, or, for a module, naming a script of the same folder
    that imports it. A clear error if not."""
    first = source.split("\n", 1)[0]
    line = first[3:].rstrip() if first[:3] in ('"""', "'''") else ""
    script = next((word for word in line.split() if word.endswith(".py")), None)
    if line.startswith(("torchrun ", "python ")) and (
            script == relative
            or MODULE in line and script and Path(script).parent == Path(relative).parent):
        return line
    raise ValueError(
        f"workers/{relative}: its docstring must start with the line that runs it, e.g. "
        f'"""torchrun --standalone --nproc-per-node=2 {relative} (or "python {relative}", or, for a '
        f'module, "torchrun ... {Path(relative).parent}/train.py imports this module; not run on its '
        f'own."). Found: {first[:80]!r}. Add that line as the first line of the script, under %%writefile.')


def notebooks(root, sources=None) -> list[Path]:
    """The chapter notebooks to export from: ``sources`` (folders or notebook files, relative
    to the working directory), by default the course's lectures and solutions."""
    paths = []
    for source in sources or [Path(root) / folder for folder in SOURCES]:
        source = Path(source)
        if source.is_file():
            paths.append(source)
        elif source.is_dir():
            paths += sorted(source.glob("[0-9][0-9]_*.ipynb"))
        else:
            raise FileNotFoundError(f"--from {source}: no such notebook or folder")
    return paths


def collect(root, sources=None) -> dict[str, str]:
    """{"NN_topic/name.py": text with its run line} for every chapter of ``sources``."""
    collected = {}
    for notebook_path in notebooks(root, sources):
        notebook = nbformat.read(notebook_path, as_version=4)
        for relative, source in worker_cells(notebook).items():
            if relative in collected and collected[relative] != source:
                raise ValueError(f"two notebooks write different workers/{relative}: give one "
                                 f"of them another name (second one: {notebook_path})")
            if not is_blank(source):  # every worker says how it runs (a blank is named, not run)
                run_line(relative, source)
            collected[relative] = source
    return collected


def export(root, out, sources=None) -> list[Path]:
    """Write every worker of ``sources`` under ``out``, and the README for the node; return
    the workers' paths."""
    out = Path(out)
    written = []
    for relative, text in collect(root, sources).items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    (out / "README.md").write_text(node_readme(out, written))
    return written


def is_blank(source: str) -> bool:
    """True while a worker still holds an exercise's blank (its NotImplementedError stub)."""
    return "raise NotImplementedError(" in source


def unanswered(paths) -> list[Path]:
    """The exported workers that still hold an exercise's blank (NotImplementedError)."""
    return [path for path in paths if is_blank(path.read_text())]


def node_readme(out: Path, written: list[Path]) -> str:
    lines = [f"    {path.read_text().splitlines()[0][3:]}" for path in sorted(written)
             if not is_blank(path.read_text()) and MODULE not in path.read_text().splitlines()[0]]
    return README.format(runs="\n".join(lines))


README = """# Worker scripts, ready for a GPU node

Written by `spike-course workers`. Each script's first line says how it runs; run it from
this folder, with the script's path as shown:

{runs}

On a DGX node (8 GPUs) give torchrun `--nproc-per-node=8`; a script then uses NCCL, one GPU
per process. Copy this folder to your project volume first (a pod's own disk disappears
with the pod), and build the `runai training pytorch submit` line with
`spike_course.runai` (chapter 07 explains every flag).

The scripts import `spike_course` (its `runtime`, `data` and `models` modules need only
torch, torchvision and numpy): in a PyTorch image, `pip install --no-deps` the course folder,
which keeps the image's own CUDA build of torch, or build the environment from
`environment.yml`. Outside a notebook, `runtime.report()` and `runtime.progress()` do
nothing, and collectives get PyTorch's own timeout.
"""
