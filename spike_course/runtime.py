"""What a worker script calls: ``setup()`` at the start, ``report()`` to send results
back to the notebook, ``progress()`` to move its progress bar, ``teardown()`` at the end.

The same script runs under ``spike_course.launch`` on a laptop (gloo, CPU) and under
``torchrun`` on a GPU node (NCCL, one process per GPU): ``setup`` reads the rank from the
environment both set and picks the backend from the hardware.

    from spike_course import runtime
    ctx = runtime.setup()            # ctx.rank, ctx.world_size, ctx.local_rank, ctx.device
    ...
    runtime.report(loss=loss.item())
    runtime.teardown()
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when setup() runs, not when this module is
    import torch

from .protocol import (COLLECTIVE_TIMEOUT_ENV, PARENT_PID_ENV, RESULTS_DIR_ENV, write_progress,
                       write_result)

BACKENDS = ("gloo", "nccl")
_reported: dict = {}


@dataclass(frozen=True)
class Context:
    """Where this rank stands: its place in the world and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(
            f"{name} is not set: this worker must be started by a launcher, not run on its own. "
            "From a notebook use spike_course.launch('this_script.py', nproc=2); from a shell use "
            "torchrun --standalone --nproc-per-node=2 this_script.py")
    return int(value)


def setup(backend: str | None = None, device: str | None = None, seed: int | None = 0,
          memory_fraction: float | None = None, timeout: float | None = None,
          tf32: bool = False) -> Context:
    """Join the process group and return this rank's :class:`Context`.

    backend: "nccl" or "gloo"; by default nccl when CUDA GPUs are present, else gloo.
    device: "cuda" or "cpu"; by default it follows the backend. With CUDA each rank takes
        GPU ``local_rank % gpu_count`` (gloo may put several ranks on one GPU; NCCL may not).
    seed: seeds python, numpy and torch the same on every rank (None: leave unseeded).
    memory_fraction: cap this process's share of its GPU's memory (e.g. 0.5). It limits
        memory only, not compute, and the GPU's other tenants still compete for SMs.
    timeout: seconds a collective may wait before it fails. By default: 60 s when
        ``spike_course.launch`` started the ranks (a notebook should not hang for half an
        hour on a rank that skipped a collective), and PyTorch's own default under plain
        torchrun (30 min for gloo, 10 min for NCCL), which a slow first batch or a rank-0
        checkpoint save on a cluster needs.
    tf32: on CUDA GPUs, let float32 matmuls and cuDNN convolutions use TF32 tensor cores
        (about 3 decimal digits; PyTorch 2.14 does so for convolutions by default). False
        pins full float32, so that a GPU run can be compared with a float32 CPU reference.
    """
    import torch
    import torch.distributed as dist

    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    _watch_parent()

    has_cuda = torch.cuda.is_available()
    if device is not None and device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}: use 'cpu' or 'cuda'")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use 'gloo' (CPU, or several ranks per GPU) "
                         "or 'nccl' (one process per CUDA GPU)")
    if (device == "cuda" or backend == "nccl") and not has_cuda:
        raise RuntimeError(
            f"CUDA was asked for (device={device!r}, backend={backend!r}) but torch sees no GPU on "
            "this machine. Leave device and backend unset to train on the CPU with gloo.")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if backend is None and device is None and has_cuda and local_ranks > torch.cuda.device_count():
        # More ranks than GPUs (4 ranks on a 1-GPU laptop): NCCL cannot, so stay on the CPU.
        if rank == 0:
            print(f"{local_ranks} ranks on {torch.cuda.device_count()} GPU(s): NCCL needs one process "
                  "per GPU, so this run uses gloo on the CPU (backend='gloo', device='cuda' shares GPUs)",
                  flush=True)
        backend, device = "gloo", "cpu"
    backend = backend or ("nccl" if has_cuda and device != "cpu" else "gloo")
    device_type = device or ("cuda" if backend == "nccl" else "cpu")

    if device_type == "cuda":
        gpu = local_rank % torch.cuda.device_count()
        if backend == "nccl" and local_ranks > torch.cuda.device_count():
            raise RuntimeError(
                f"{local_ranks} ranks on {torch.cuda.device_count()} GPUs: NCCL "
                "allows one process per GPU. Start fewer ranks, or use backend='gloo' to share GPUs.")
        torch.cuda.set_device(gpu)
        torch_device = torch.device("cuda", gpu)
        if memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(memory_fraction, gpu)
    else:
        torch_device = torch.device("cpu")

    if device_type == "cuda":
        precision = "tf32" if tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision

    if not dist.is_initialized():
        # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when
        # it is first imported, and torch._dynamo (which every optimizer and DDP import)
        # imports it. Imported after init_process_group, those defaults keep the group alive
        # after destroy_process_group: gloo's threads then run on while Python shuts down,
        # which aborted about 1 exit in 100 here ("terminate called without an active
        # exception"). Imported first, the defaults are None: the default group at call time.
        import torch.distributed.nn  # noqa: F401
        options = {"backend": backend}
        timeout = timeout if timeout is not None else os.environ.get(COLLECTIVE_TIMEOUT_ENV)
        if timeout is not None:  # else init_process_group's default for the backend
            options["timeout"] = timedelta(seconds=float(timeout))
        if backend == "nccl":
            options["device_id"] = torch_device  # binds the communicator to this rank's GPU
        dist.init_process_group(**options)
    if seed is not None:
        seed_everything(seed)
    return Context(rank, world_size, local_rank, torch_device, backend)


def seed_everything(seed: int) -> None:
    """Same seed for python, numpy and torch, so every rank builds the same initial model."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def report(**values) -> None:
    """Send values back to the notebook: they appear in ``launch(...).reports[rank]``.

    Call it as often as you like; later keys update earlier ones. Tensors are moved to
    the CPU first. Under a plain torchrun (no notebook listening) it does nothing.
    """
    results_dir = os.environ.get(RESULTS_DIR_ENV)
    if not results_dir:
        return
    _reported.update({key: _to_cpu(value) for key, value in values.items()})
    write_result(results_dir, int(os.environ.get("RANK", 0)), _reported)


def progress(step: int, total: int, note: str = "") -> None:
    """Tell the notebook this rank has done ``step`` of ``total`` (one progress bar per rank)."""
    results_dir = os.environ.get(RESULTS_DIR_ENV)
    if results_dir:
        write_progress(results_dir, int(os.environ.get("RANK", 0)), step, total, note)


def _to_cpu(value):
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        # A copy: on the CPU .cpu() returns the same tensor, which training would keep changing.
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def teardown() -> None:
    """Leave the process group cleanly.

    The barrier first matters: ranks that reach ``destroy_process_group`` at different
    times (one still gathering a state dict, say) can abort at exit.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        _wait_for_idle_gloo_threads()


def _wait_for_idle_gloo_threads(timeout: float = 1.0) -> None:
    """Wait, at most ``timeout`` seconds, until gloo's worker threads sit idle.

    A gloo worker thread lets go of a finished collective, and of the tensors it holds,
    just after the collective has returned; a barrier holds on to the collectives before
    it. When something still holds the process group after ``destroy_process_group`` (a
    DDP or FSDP module does), those threads live on, and if one lets go of a tensor that
    Python made while Python is already shutting down, it cannot take the GIL and the
    process aborts: "terminate called without an active exception" (about 1 exit in 100
    of chapter 06's ZeRO-1 worker on a loaded machine). Idle threads wait in a condition
    variable (state S). Linux only, through /proc; elsewhere it returns at once.
    """
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return
    deadline, idle_polls = time.monotonic() + timeout, 0
    # A thread waiting for the GIL shows S as well, but gets it while this one sleeps.
    while idle_polls < 3 and time.monotonic() < deadline:  # three times in a row, 2 ms apart
        states = []
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/comm") as comm, open(f"{tasks}/{tid}/stat") as stat:
                    if comm.read().strip() == "pt_gloo_runloop":
                        states.append(stat.read().rsplit(")", 1)[1].split()[0])
            except OSError:  # the thread ended meanwhile
                continue
        idle_polls = idle_polls + 1 if all(state == "S" for state in states) else 0
        time.sleep(0.002)


def _watch_parent() -> None:
    """Exit if the notebook kernel that launched us dies, so no rank is left orphaned.

    A fresh rank also has SIGKILL-on-parent-death from the kernel, and a warm one from its
    server (which dies with the kernel), but torchrun's workers are the kernel's
    grandchildren and need this watchdog.
    """
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return

    def watch():
        while True:
            try:
                os.kill(int(parent), 0)
            except ProcessLookupError:
                print(f"rank {os.environ.get('RANK')}: the launching process is gone; exiting",
                      file=sys.stderr, flush=True)
                os._exit(1)
            except PermissionError:
                pass
            time.sleep(1.0)

    threading.Thread(target=watch, name="spike-course-parent-watch", daemon=True).start()
