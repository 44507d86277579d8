"""Run a notebook headless, as "Run all" would: one place for the nbclient set-up that
``spike-course run``, ``grade`` and ``gpu-check`` share, and for the private kernels that
``spike-course html`` starts too."""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import nbformat


def _listen_privately(kernel, sockets: str, name: str):
    """Make ``kernel`` (a KernelManager not started yet) listen on sockets in the private
    folder ``sockets``, not on TCP ports: ipykernel warns, once per kernel and in the middle of
    whatever is being reported, that TCP carries the notebook unencrypted."""
    kernel.transport, kernel.ip = "ipc", os.path.join(sockets, name)
    return kernel


@contextlib.contextmanager
def private_kernels():
    """Every kernel that nbclient starts inside this block (myst-nb's, through jupyter-cache,
    which takes no kernel manager of ours) listens privately, as ``run_notebook``'s does."""
    from nbclient import NotebookClient

    create = NotebookClient.create_kernel_manager
    numbers = itertools.count()
    with tempfile.TemporaryDirectory(prefix="spike-course-kernels-") as sockets:
        def create_private(client):
            return _listen_privately(create(client), sockets, f"kernel-{next(numbers)}")

        with mock.patch.object(NotebookClient, "create_kernel_manager", create_private):
            yield


@dataclass
class Run:
    notebook: nbformat.NotebookNode  # with its outputs, as far as it got
    seconds: float
    error: str | None                # "cell N: Name: message", or why the run stopped; None if it passed


def run_notebook(path, timeout: int = 600, allow_errors: bool = False, notebook=None) -> Run:
    """Execute the notebook at ``path`` in its own folder (``notebook``, when given, runs in
    place of the file's content). A failing cell, a timeout or a dead kernel is reported in
    ``Run.error``, not raised: callers show it and go on with the next notebook."""
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    path = Path(path)
    notebook = notebook if notebook is not None else nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="spike-course-kernel-") as sockets:
        kernel = _listen_privately(KernelManager(kernel_name="python3"), sockets, "kernel")
        client = NotebookClient(notebook, km=kernel, timeout=timeout, allow_errors=allow_errors,
                                resources={"metadata": {"path": str(path.parent)}})
        started = time.perf_counter()
        try:
            client.execute(cleanup_kc=True)  # shut the kernel down at the end, as for a kernel of its own
            stopped = None
        except Exception as failure:
            stopped = f"{type(failure).__name__}: {str(failure).strip().splitlines()[-1][:300]}"
        seconds = time.perf_counter() - started
    failed = failing_cells(notebook)
    error = failed[0] if failed and not allow_errors else stopped
    return Run(notebook, seconds, error)


def failing_cells(notebook) -> list[str]:
    """"cell N: Name: message" for every code cell of an executed notebook that raised."""
    found = []
    for index, cell in enumerate(notebook.cells):
        errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        if cell.cell_type == "code" and errors:
            found.append(f"cell {index}: {errors[0].ename}: {errors[0].evalue[:300]}")
    return found
