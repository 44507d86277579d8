"""Export every chapter's worker scripts for the cluster, without running a notebook.

A chapter writes its workers with ``%%writefile workers/NN_topic/name.py`` cells, so
they exist only after the notebook ran. ``spike-course workers --out DIR`` reads those
cells from the lectures and the solutions (or, with ``--from exercises``, from a learner's
own notebooks) and writes ``DIR/NN_topic/name.py`` as the cell has it, and
``DIR/README.md`` on how to run them on a GPU node. Every worker's docstring starts with
the command that runs it, as nanoGPT's scripts do (``torchrun --standalone
--nproc-per-node=2 03_data_parallel/train.py``; a module's names the script that imports
it), and a demonstration that ends in an error on purpose says so in a line of its
docstring that starts with ``Fails on purpose:``: the author writes both, nothing guesses them.
"""

from __future__ import annotations

import ast
from itertools import groupby
from pathlib import Path

import nbformat

from .conventions import stub_lines, without_markers, written_files

SOURCES = ("notebooks", "solutions")


def worker_cells(notebook) -> dict[str, str]:
    """{"NN_topic/name.py": source} for every Python worker a notebook writes."""
    return {path.removeprefix("workers/"): without_markers(text)
            for path, text in written_files(notebook).items()
            if path.startswith("workers/") and path.endswith(".py")}


MODULE = " imports this module"  # in a module's run line: the script that runs it
FAILS = "Fails on purpose:"  # starts the docstring line of a worker whose run ends in an error


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
            if not stub_lines(source):  # every worker says how it runs (a blank is named, not run)
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


def unanswered(paths) -> list[Path]:
    """The exported workers that still hold an exercise's blank (NotImplementedError)."""
    return [path for path in paths if stub_lines(path.read_text())]


def fails_on_purpose(source: str) -> str | None:
    """What a worker's docstring says of the error its run ends in on purpose, or None."""
    docstring = ast.get_docstring(ast.parse(source)) or ""
    paragraph = next((p for p in docstring.split("\n\n") if p.startswith(FAILS)), None)
    return " ".join(paragraph[len(FAILS):].split()) if paragraph else None


def node_readme(out: Path, written: list[Path]) -> str:
    """The README for the node: every runnable worker's own run line, by chapter, the ones
    that fail on purpose marked and explained."""
    runnable = {path.relative_to(out).as_posix(): path.read_text() for path in sorted(written)}
    runnable = {name: source for name, source in runnable.items()
                if not stub_lines(source) and MODULE not in source.split("\n", 1)[0]}
    blocks, failures = [], []
    for _, names in groupby(runnable, key=lambda name: name.split("/")[0]):
        lines = []
        for name in names:
            why = fails_on_purpose(runnable[name])
            lines.append(f"    {runnable[name].split(chr(10), 1)[0][3:]}" + ("    # fails on purpose" if why else ""))
            if why:
                failures.append(f"- `{name}`: {why}")
        blocks.append("\n".join(lines))
    return README.format(runs="\n\n".join(blocks), failures="\n".join(failures),
                         two_nodes=_two_nodes_line())


def _two_nodes_line() -> str:
    """Chapter 03's training on two DGX nodes, as the cluster runs it (a test rehearses it)."""
    from .. import runai

    return runai.submit_command(
        "ddp-two-nodes", "registry.example.org/team/image:tag", "my-project",
        "cd /data/cluster_workers; " + runai.torchrun_command("03_data_parallel/train.py", master=True),
        gpus=8, workers=1, pvc="my-volume", cpu=56, memory="512G")


README = """# Worker scripts, ready for a GPU node

Written by `spike-course workers`. Run every line below from this folder, the folder of this
README: each line names its script by its path from here, and a script imports the helper
modules next to it (`common.py`, ...) from its own folder. (The notebooks write the same
scripts, under the same names, to `notebooks/workers/` when they run: the lines work from
there too.)

Each line is the first line of its script's docstring, written by its author, with the
number of processes the script was written for. Keep that number: many scripts need exactly
it (a pipeline of 2 stages, 2-way tensor parallelism, 3 federated clients, a 2 x 2 mesh of
4 ranks) and stop, or fail, with another. Data-parallel training takes any number:
`torchrun --standalone --nproc-per-node=8 03_data_parallel/train.py` uses the 8 GPUs of a
DGX node. On a GPU node each process uses NCCL and a GPU of its own; with more processes
than GPUs (a Run:ai GPU fraction) they share the GPUs, and `runtime.setup` sets
`NCCL_MULTI_RANK_GPU_ENABLE=1`, without which the NCCL of torch 2.14.1 refuses that.

{runs}

## Input files

Some lines name a file that a notebook cell writes before it launches the script:

- `--batch-file BATCH.pt` (chapter 04): one batch of digits, `(images, labels)`;
- `--data-file DIGITS.pt` (chapter 04): `(train images, train labels, test images, test labels)`;
- `--data ...` (chapter 17): the small file of tensors the capstone's check writes
  (`17_capstone_your_own_job/capstone_check/data.pt`, once the check has run); leave `--data`
  out to train on MNIST.

This writes chapter 04's two files (from MNIST in `data/`, or the course's synthetic digits
where MNIST is missing), as its notebooks do:

    python - <<'EOF'
    import torch
    from spike_course.data import load_mnist
    digits = load_mnist(limit=192)
    images = torch.stack([digits[i][0] for i in range(192)])
    labels = torch.tensor([digits[i][1] for i in range(192)])
    torch.save((images[:64], labels[:64]), "04_pipeline_parallel/batch.pt")
    torch.save((images[:128], labels[:128], images[128:], labels[128:]), "04_pipeline_parallel/digits.pt")
    EOF

and then, e.g., `--batch-file 04_pipeline_parallel/batch.pt`.

## Demonstrations that fail on purpose

The lines marked `# fails on purpose` end in an error: the error is what their chapter shows.

{failures}

## On the cluster

Copy this folder to your project volume first (a pod's own disk disappears with the pod),
and build the `runai training pytorch submit` line with `spike_course.runai` (chapter 07
explains every flag). Chapter 03's training on two DGX nodes (a master pod and one worker,
8 GPUs each), with the folder copied to `/data/cluster_workers` on the volume:

    {two_nodes}

Note `exec` (Kubernetes' SIGTERM then reaches torchrun) and the master's address (torchrun
never reads `MASTER_ADDR` itself). Before submitting a line of your own, run
`spike-course rehearse 'LINE' --volume FOLDER` on your laptop: it runs the pods there as the
cluster would and names what would go wrong (chapter 07, section 7.6).

The scripts import `spike_course` (its `runtime`, `data` and `models` modules need only
torch, torchvision and numpy): in a PyTorch image, `pip install --no-deps` the course folder,
which keeps the image's own CUDA build of torch, or build the environment from
`environment.yml`. Outside a notebook, `runtime.report()` and `runtime.progress()` do
nothing, and collectives get PyTorch's own timeout.
"""
