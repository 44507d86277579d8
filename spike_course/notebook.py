"""The first code cell of every chapter: ``spike_course.notebook.setup("03_data_parallel")``.

It seeds, creates the folder the chapter's ``%%writefile`` cells write their worker
scripts to (``%%writefile`` does not create folders), prints what hardware this kernel
sees, so a learner knows from the start whether the chapter will run on GPUs, and starts
the warm start server in the background, so that the chapter's first launch is quick too.
"""

from __future__ import annotations

import os
from pathlib import Path


def setup(stem: str, seed: int = 0, quiet: bool = False) -> Path:
    """Prepare chapter ``stem`` (e.g. "03_data_parallel") and return its workers folder."""
    from .lab.launcher import prestart_warm_server
    from .runtime import seed_everything

    prestart_warm_server()
    show_figures_inline()
    seed_everything(seed)
    workers = Path("workers") / stem
    workers.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"chapter {stem}: worker scripts go to {workers}/")
        print(describe_devices())
    return workers


def show_figures_inline() -> None:
    """Make a kernel show its figures although ``MPLBACKEND`` says otherwise.

    A cluster shell often exports ``MPLBACKEND=Agg`` so that batch jobs can save figures
    without a display; a JupyterLab started from that shell passes it to every kernel, and
    the kernel then draws no figure at all, silently. Only in a Jupyter kernel: a script or
    a terminal IPython keeps the backend it was given.
    """
    backend = os.environ.get("MPLBACKEND", "")
    if not backend or "inline" in backend:
        return
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or not hasattr(shell, "kernel"):
        return
    shell.run_line_magic("matplotlib", "inline")
    print(f"MPLBACKEND={backend} in this kernel's environment would hide every figure: showing them "
          "inline instead (unset MPLBACKEND before starting JupyterLab to drop this line)")


def describe_devices(nproc: int = 2) -> str:
    """One line on what this machine offers the workers: torch, CPU cores, GPUs and what a
    chapter's usual ``nproc`` ranks will use there (``runtime.choose_placement`` decides).
    The one description of the hardware: every chapter's first cell, ``spike-course
    doctor``, ``gpu-check`` and the rendered edition print it."""
    import torch

    from .runtime import choose_placement

    cpus = os.cpu_count() or 1
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus:
        return (f"torch {torch.__version__}, {cpus} CPU cores, no CUDA GPU: workers will use gloo "
                "on the CPU (the same scripts use NCCL on GPUs)")
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
    placement = choose_placement(nproc, gpus, nccl_version=torch.cuda.nccl.version())
    where = "the CPU" if placement.device_type == "cpu" else "the GPUs"
    return (f"torch {torch.__version__}, {cpus} CPU cores, {gpus} CUDA GPU(s): {names}; {nproc} "
            f"ranks will use {placement.backend.upper()} on {where}"
            + (f" ({placement.note})" if placement.note else ""))
