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
    from .launcher import prestart_warm_server
    from .runtime import seed_everything

    prestart_warm_server()
    seed_everything(seed)
    workers = Path("workers") / stem
    workers.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"chapter {stem}: worker scripts go to {workers}/")
        print(describe_devices())
    return workers


def describe_devices() -> str:
    """One line on what this machine offers the workers: torch, CPU cores, GPUs and the
    backend they will use. The one description of the hardware: every chapter's first
    cell, ``spike-course doctor`` and the rendered edition print it."""
    import torch

    cpus = os.cpu_count() or 1
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        gpus = f"{len(names)} CUDA GPU(s): " + ", ".join(names) + "; workers will use NCCL"
    else:
        gpus = "no CUDA GPU: workers will use gloo on the CPU (the same scripts use NCCL on GPUs)"
    return f"torch {torch.__version__}, {cpus} CPU cores, {gpus}"
