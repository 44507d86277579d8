"""Run a job's pods on this machine as the cluster would, and preempt them if asked.

Every pod is a process group started with its own command and the environment the operator
injects; pod names resolve to loopback addresses of their own (127.0.0.2, 127.0.0.3, ...),
so that a pod that meets on its own 127.0.0.1 would not find the others; the volume is a
copy, so that nothing the job writes touches the learner's files. With ``preempt_at``, every
pod's first process gets SIGTERM at that second, as Kubernetes sends it, and whatever still
runs at the end of the line's grace period gets SIGKILL.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ..lab.launcher import free_port
from . import pods, reading as reading_

# The line's own mistakes that a single machine would hide (all pods share its 127.0.0.1
# and its ports): the rehearsal names them and does not run the job.
CLUSTER_ONLY = {"own-loopback", "standalone-several-pods", "meeting-points-differ",
                "node-ranks-clash", "pods-against-nnodes", "no-torchrun-several-pods",
                "pod-launches-nothing", "torchrun-refused", "no-processes"}
POLL = 0.1


@dataclass
class Process:
    """One process of a pod, from the records its sitecustomize wrote."""
    pid: int
    pod: str
    argv: list[str]
    agent: bool
    environment: dict
    started: float
    sigterm: float | None = None
    exited: float | None = None      # a normal exit (atexit ran)
    gone: float | None = None        # when the rehearsal saw it gone, whatever the cause
    writes: list[tuple[float, str]] = field(default_factory=list)

    @property
    def rank(self) -> int | None:
        value = self.environment.get("RANK")
        return int(value) if value is not None and not self.agent else None


@dataclass
class Run:
    reading: reading_.Reading
    ran: bool
    folder: Path | None = None
    volume: Path | None = None
    began: float = 0.0
    ended: float = 0.0
    ranks_up: float | None = None         # every rank had joined its group, seconds after the start
    sigterm_at: float | None = None       # seconds after the start
    killed_at: float | None = None        # the kubelet's SIGKILL, seconds after the start
    timed_out: bool = False
    exit_codes: dict = field(default_factory=dict)
    logs: dict = field(default_factory=dict)
    processes: list[Process] = field(default_factory=list)
    checkpoint: dict | None = None
    gone: dict = field(default_factory=dict)   # pid -> when the rehearsal saw it gone

    def shown(self, path: str) -> str:
        """A path as the pod would name it: under the volume's mount, or under its home (~)."""
        if self.volume is not None and path.startswith(str(self.volume)):
            return (self.reading.job.mount or "<volume>") + path[len(str(self.volume)):]
        homes = str(self.volume.parent / "homes") if self.volume is not None else None
        if homes and path.startswith(homes + "/"):   # homes/<pod>/rest
            return "~/" + path[len(homes) + 1:].split("/", 1)[-1]
        return path

    @property
    def ranks(self) -> list[Process]:
        return sorted((p for p in self.processes if p.rank is not None), key=lambda p: p.rank)

    def seconds(self, t: float | None) -> float | None:
        return None if t is None else t - self.began


def rehearse(text: str, *, volume: str | Path | None = None, flavour: str = "older",
             preempt_at: float | None = None, timeout: float = 120.0,
             gpus_per_pod: float | None = None, cwd: str | Path | None = None,
             keep: bool = False) -> Run:
    """Run the job ``text`` here. volume: the folder that stands for the job's persistent
    volume (copied; the copy is the run's ``volume``). preempt_at: seconds after every rank
    has joined its process group (starting takes longer on a laptop than on a node) when each
    pod gets SIGTERM.
    gpus_per_pod: how many ranks ``--nproc-per-node=gpu`` starts (default: the GPUs the line
    asks for)."""
    line = reading_.read(text, flavour, gpus_per_pod)
    from .findings import LINE, seen
    if CLUSTER_ONLY & {name for name, _ in seen(LINE, line)}:
        return Run(line, ran=False)
    folder = Path(tempfile.mkdtemp(prefix="rehearsal-"))
    run = Run(line, ran=True, folder=folder)
    try:
        _run(run, volume, preempt_at, timeout, cwd)
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
            run.folder = None
    return run


def _run(run: Run, volume, preempt_at, timeout, cwd) -> None:
    job, folder = run.reading.job, run.folder
    tools, records = pods.make_tools(folder, dry=False), folder / "records"
    records.mkdir()
    run.volume = folder / "volume"
    if volume is not None:
        shutil.copytree(volume, run.volume, symlinks=True)
    else:
        run.volume.mkdir()
    hosts, port = _hosts(job.pods), free_port()
    workdir = Path(cwd) if cwd is not None else (folder / "workdir")
    workdir.mkdir(exist_ok=True)
    started, outputs = {}, {}
    run.began = time.time()
    for pod in job.pods:
        injected = {k: pods.on_this_machine(v, job.mount, run.volume)
                    for k, v in pod.env(hosts, port).items()}
        env = pods.pod_environment(injected, home=pods.home_of(tools, pod.name), records=records, pod=pod.name, gpus=pod.gpus)
        command = [pods.on_this_machine(word, job.mount, run.volume) for word in pod.command]
        outputs[pod.name] = open(folder / f"{pod.name}.log", "wb")
        started[pod.name] = pods.start(command, env, workdir, outputs[pod.name])
    try:
        _watch(run, started, records, preempt_at, timeout)
    finally:
        for process in started.values():
            pods.kill_pod(process)
        for output in outputs.values():
            output.close()
    run.exit_codes = {name: process.wait() for name, process in started.items()}
    run.logs = {pod.name: (folder / f"{pod.name}.log").read_text(errors="replace") for pod in job.pods}
    run.processes = _processes(records, run.gone)
    from .checkpoints import last_checkpoint
    run.checkpoint = last_checkpoint(run)


def _watch(run, started, records, preempt_at, timeout) -> None:
    """Poll until every process of every pod is gone, sending SIGTERM and SIGKILL on time."""
    seen, gone = {}, {}
    grace = run.reading.job.grace
    while True:
        now = time.time()
        if run.ranks_up is None and _ranks_joined(records) >= run.reading.world_size:
            run.ranks_up = now - run.began
        for pid in _alive_pids(started, records):
            seen.setdefault(pid, now)
        for pid in list(seen):
            if pid not in gone and not _alive(pid):
                gone[pid] = now
        if preempt_at is not None and run.sigterm_at is None and run.ranks_up is not None \
                and now - run.began >= run.ranks_up + preempt_at:
            run.sigterm_at = now - run.began
            for process in started.values():   # Kubernetes signals each container's first process
                _signal(process.pid, signal.SIGTERM)
        if run.sigterm_at is not None and run.killed_at is None and now - run.began >= run.sigterm_at + grace:
            run.killed_at = now - run.began
            _kill_all(seen)
        if now - run.began > timeout and run.killed_at is None:
            run.timed_out, run.killed_at = True, now - run.began
            _kill_all(seen)
        if all(process.poll() is not None for process in started.values()) and all(
                pid in gone for pid in seen):
            break
        time.sleep(POLL)
    run.ended = time.time()
    run.gone = gone


def _ranks_joined(records: Path) -> int:
    """Rank processes whose init_process_group has returned (the pods' sitecustomize says so)."""
    return sum('"event": "joined"' in path.read_text(errors="replace") for path in records.glob("*.jsonl"))


def _alive_pids(started, records) -> set[int]:
    pids = set()
    for process in started.values():
        try:
            main = psutil.Process(process.pid)
            pids |= {process.pid} | {child.pid for child in main.children(recursive=True)}
        except psutil.Error:
            continue
    for path in records.glob("*.jsonl"):   # processes that left their pod's tree (orphans)
        pids.add(int(path.stem))
    return {pid for pid in pids if _alive(pid)}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _kill_all(pids) -> None:
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def _processes(records: Path, gone: dict) -> list[Process]:
    """Each recorded process with what it saw and did."""
    processes = {}
    for record in pods.read_records(records):
        pid = record["pid"]
        if record["event"] == "start":
            processes[pid] = Process(pid, record.get("pod") or "?", record["argv"], record["agent"],
                                     record["env"], record["t"], gone=gone.get(pid))
        elif pid in processes:
            process = processes[pid]
            if record["event"] == "sigterm" and process.sigterm is None:
                process.sigterm = record["t"]
            elif record["event"] == "exit":
                process.exited = record["t"]
            elif record["event"] in ("write", "rename"):
                process.writes.append((record["t"], record["path"]))
    return list(processes.values())


def _hosts(job_pods) -> dict:
    """Pod name -> a loopback address of its own where this machine allows it."""
    addresses = [f"127.0.0.{2 + i}" for i in range(len(job_pods))]
    if not all(_bindable(a) for a in addresses):
        addresses = ["127.0.0.1"] * len(job_pods)
    return {pod.name: address for pod, address in zip(job_pods, addresses)}


def _bindable(address: str) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((address, 0))
            return True
        except OSError:
            return False

