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
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when setup() runs, not when this module is
    import torch

from .protocol import (COLLECTIVE_TIMEOUT_ENV, PARENT_PID_ENV, PLACEMENT_LOG_ENV, RESULTS_DIR_ENV,
                       append_line, write_progress, write_result)

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


# The first NCCL seen to let several processes share one GPU, once NCCL_MULTI_RANK_GPU_ENABLE=1
# says so (the one in torch 2.14.1's wheel). Older ones stop with "Duplicate GPU detected";
# they were not checked, so the course does not rely on them.
NCCL_SHARES_GPUS_FROM = (2, 30)


@dataclass(frozen=True)
class Placement:
    """Which backend a rank joins with and which kind of device it computes on."""

    backend: str          # "nccl" or "gloo"
    device_type: str      # "cuda" or "cpu"
    shares_gpu: bool      # more ranks on this node than GPUs: several ranks per GPU
    note: str = ""        # why, when it is not the plain "one rank per GPU" or "no GPU"


def choose_placement(local_ranks: int, gpus: int, backend: str | None = None,
                     device: str | None = None, nccl_version: tuple = (0,)) -> Placement:
    """The course's one policy for "which backend and device does a rank use".

    ``local_ranks`` ranks on this node, ``gpus`` CUDA GPUs visible. By default: gloo on
    the CPU without a GPU; NCCL with one GPU per rank; with more ranks than GPUs, NCCL with
    ranks sharing the GPUs (a GPU fraction under Run:ai) where this NCCL allows it, else
    gloo on the CPU. ``backend``/``device`` given by the script are obeyed or refused with
    the reason. ``runtime.setup``, ``spike-course gpu-check`` and every chapter's first
    cell all ask this function, so they cannot disagree.
    """
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}: use 'cpu' or 'cuda'")
    if backend not in (None, *BACKENDS):
        raise ValueError(f"unknown backend {backend!r}: use 'gloo' (CPU, or several ranks per GPU) "
                         "or 'nccl' (CUDA GPUs)")
    if (device == "cuda" or backend == "nccl") and not gpus:
        raise RuntimeError(
            f"CUDA was asked for (device={device!r}, backend={backend!r}) but torch sees no GPU on "
            "this machine. Leave device and backend unset to train on the CPU with gloo.")
    if backend == "nccl" and device == "cpu":
        raise ValueError("backend='nccl' moves CUDA tensors only: use device='cuda', or backend='gloo' "
                         "for the CPU")
    if not gpus or device == "cpu" or (backend == "gloo" and device is None):
        return Placement("gloo", "cpu", False)
    shares = local_ranks > gpus
    asked, backend = backend, backend or "nccl"
    if shares and backend == "nccl" and tuple(nccl_version) < NCCL_SHARES_GPUS_FROM:
        why = (f"{local_ranks} ranks on {gpus} GPU(s), and NCCL {'.'.join(map(str, nccl_version))} "
               "allows one process per GPU")
        if asked == "nccl":
            raise RuntimeError(f"{why}: start fewer ranks, or use backend='gloo' to share GPUs")
        if device == "cuda":
            return Placement("gloo", "cuda", True, why + ", so they share the GPUs through gloo")
        return Placement("gloo", "cpu", False, why + ", so the ranks use gloo on the CPU")
    note = f"{local_ranks} ranks share {gpus} GPU(s)" if shares else ""
    return Placement(backend, "cuda", shares, note)


def setup(backend: str | None = None, device: str | None = None, seed: int | None = 0,
          memory_fraction: float | None = None, timeout: float | None = None,
          tf32: bool = False, deterministic: bool = True) -> Context:
    """Join the process group and return this rank's :class:`Context`.

    backend: "nccl" or "gloo"; device: "cuda" or "cpu". By default they follow the
        hardware (see :func:`choose_placement`). With CUDA each rank takes GPU
        ``local_rank % gpu_count``; with more ranks than GPUs they share them, which NCCL
        allows only with NCCL_MULTI_RANK_GPU_ENABLE=1 (set here when it is needed).
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
    deterministic: on CUDA GPUs, use deterministic kernels where torch has them (cuDNN
        picks its algorithm per run, and some kernels add with atomics in a varying
        order), so that two runs of the same job give the same bits, as they do on a CPU.
    """
    import torch
    import torch.distributed as dist

    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    _watch_parent()

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = torch.cuda.nccl.version() if gpus else (0,)
    placement = choose_placement(local_ranks, gpus, backend, device, nccl)
    if placement.note and rank == 0:
        print(f"runtime.setup: {placement.note}", flush=True)
    if placement.device_type == "cuda":
        torch_device = _take_gpu(local_rank % gpus, placement, memory_fraction, tf32, deterministic)
    else:
        torch_device = torch.device("cpu")

    if not dist.is_initialized():
        # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when
        # it is first imported, and torch._dynamo (which every optimizer and DDP import)
        # imports it. Imported after init_process_group, those defaults keep the group alive
        # after destroy_process_group: gloo's threads then run on while Python shuts down,
        # which aborted about 1 exit in 100 here ("terminate called without an active
        # exception"). Imported first, the defaults are None: the default group at call time.
        import torch.distributed.nn  # noqa: F401
        options = {"backend": placement.backend}
        timeout = timeout if timeout is not None else os.environ.get(COLLECTIVE_TIMEOUT_ENV)
        if timeout is not None:  # else init_process_group's default for the backend
            options["timeout"] = timedelta(seconds=float(timeout))
        if placement.backend == "nccl":
            options["device_id"] = torch_device  # binds the communicator to this rank's GPU
        dist.init_process_group(**options)
    if seed is not None:
        seed_everything(seed)
    _log_placement(rank, world_size, placement, torch_device)
    return Context(rank, world_size, local_rank, torch_device, placement.backend)


def _take_gpu(gpu: int, placement: Placement, memory_fraction, tf32: bool, deterministic: bool):
    """Make GPU ``gpu`` this rank's, with the float32 precision and determinism asked for."""
    import torch

    if placement.shares_gpu and placement.backend == "nccl":
        # Read by NCCL when the communicator is made, below; without it the bundled NCCL stops
        # with "Multiple Ranks are using the same GPU".
        os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    torch.cuda.set_device(gpu)
    if memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(memory_fraction, gpu)
    _set_gpu_arithmetic(tf32, deterministic)
    return torch.device("cuda", gpu)


def local_device(tf32: bool = False, deterministic: bool = True):
    """This process's device without a process group (a bag-of-tasks job): GPU
    ``LOCAL_RANK % gpu_count`` with the arithmetic ``setup`` would pin, else the CPU."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    gpu = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    _set_gpu_arithmetic(tf32, deterministic)
    return torch.device("cuda", gpu)


def _set_gpu_arithmetic(tf32: bool, deterministic: bool) -> None:
    import torch

    precision = "tf32" if tf32 else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision
    if deterministic:
        # cuBLAS reads this before its first call; warn_only: a few CUDA kernels have no
        # deterministic version, and a warning names them instead of stopping the job.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cudnn.benchmark = False


@contextmanager
def rank_arithmetic(threads: int, tf32: bool = False, deterministic: bool = True):
    """Within the block, this process adds up as a rank that reported ``threads`` did: that
    many torch threads (a convolution splits its sums by thread) and, on a GPU, the float32
    precision and determinism ``setup`` pins. A check or a cell that replays a rank's work in
    the notebook's kernel uses it, so that the replay gives the rank's very bits."""
    import torch

    saved = (torch.get_num_threads(), torch.backends.cuda.matmul.fp32_precision,
             torch.backends.cudnn.conv.fp32_precision, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.benchmark)
    torch.set_num_threads(threads)
    _set_gpu_arithmetic(tf32, deterministic)
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved[1:3]
        torch.use_deterministic_algorithms(saved[3], warn_only=saved[4])
        torch.backends.cudnn.benchmark = saved[5]


def _log_placement(rank: int, world_size: int, placement: Placement, device) -> None:
    """Append what this rank uses to the file ``spike-course gpu-check`` names, if any."""
    path = os.environ.get(PLACEMENT_LOG_ENV)
    if not path:
        return
    import torch

    on_gpu = device.type == "cuda"
    append_line(path, {
        "script": os.path.basename(sys.argv[0]), "rank": rank, "world_size": world_size,
        "backend": placement.backend, "device": str(device), "shares_gpu": placement.shares_gpu,
        "gpu": torch.cuda.get_device_name(device) if on_gpu else None,
        "precision": torch.backends.cuda.matmul.fp32_precision if on_gpu else "float32 (CPU)",
        "deterministic": torch.are_deterministic_algorithms_enabled() if on_gpu else True})


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
