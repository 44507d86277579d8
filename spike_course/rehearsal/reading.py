"""What every pod of a job would launch, read without running the job.

Each pod's command runs in a login shell whose ``torchrun``/``python`` only write down how
they were called (see :mod:`.pods`); each torchrun call is then parsed by torchrun's own
argument parser under that pod's environment, so that every ``PET_*`` default, every flag
and every shell expansion is what the cluster would see. Cluster names stand for the hosts:
nothing resolves them, nothing is started.
"""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

from . import jobs, operator, pods

LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0", "")   # "": an unset $MASTER_ADDR
DEFAULT_MASTER_PORT = 29500   # torchrun's --master-port when nothing sets it


@dataclass
class Launch:
    """One pod's torchrun (or python) call, as torchrun would take it."""
    pod: str
    tool: str                     # "torchrun" or "python"
    argv: list[str]
    environment: dict
    execs: bool                   # it replaced the pod's shell (SIGTERM reaches it)
    literal_exec: bool            # the command says `exec` before it
    error: str | None = None      # torchrun refused its arguments
    script: str | None = None
    standalone: bool = False
    nnodes: tuple[int, int] = (1, 1)
    nproc: int = 1
    node_rank: int = 0
    backend: str = "static"
    meeting: tuple[str, str] = ("", "")   # (host, port) the agents meet at
    own_loopback: bool = False           # the meeting host is this pod's own 127.0.0.1
    shutdown_timeout: int = 30
    shutdown_from: str = "torchrun's default"


@dataclass
class Reading:
    job: jobs.Job
    launches: list[Launch]
    silent_pods: list[str] = field(default_factory=list)   # started neither torchrun nor python
    shell_errors: dict = field(default_factory=dict)       # pod -> what its shell printed

    @property
    def torchruns(self) -> list[Launch]:
        return [launch for launch in self.launches if launch.tool == "torchrun" and not launch.error]

    @property
    def world_size(self) -> int:
        """Processes torchrun starts over the job: pods that join x processes per pod."""
        runs = self.torchruns
        if not runs:
            return len(self.launches)
        joined = min(len(runs), max(run.nnodes[1] for run in runs))
        return sum(run.nproc for run in runs[:joined])


def read(text: str, flavour: str = "older", gpus_per_pod: float | None = None) -> Reading:
    """Every pod's launch of the job ``text`` (a runai line or a bare command).
    gpus_per_pod: what `--nproc-per-node=gpu` counts, instead of the GPUs the line asks for."""
    job = jobs.read_job(text, flavour)
    if gpus_per_pod is not None:
        for pod in job.pods:
            pod.gpus = gpus_per_pod
    hosts = {pod.name: pod.name for pod in job.pods}
    with tempfile.TemporaryDirectory(prefix="rehearsal-read-") as scratch:
        scratch = Path(scratch)
        tools, records = pods.make_tools(scratch, dry=True), scratch / "records"
        records.mkdir()
        shell_errors, main_pids = {}, {}
        volume = scratch / "volume"   # the mount exists, so that `cd /data && ...` goes on
        volume.mkdir()
        for pod in job.pods:
            command = [pods.on_this_machine(word, job.mount, volume) for word in pod.command]
            env = pods.pod_environment(pod.env(hosts, operator.DEFAULT_PORT), home=pods.home_of(tools, pod.name),
                                       records=records, pod=pod.name, gpus=pod.gpus)
            shell = subprocess.Popen(command, env=env, cwd=scratch, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            output, _ = shell.communicate(timeout=60)
            main_pids[pod.name] = shell.pid
            if shell.returncode != 0:
                shell_errors[pod.name] = output.strip()[-2000:]
        called = pods.read_records(records, "launches.jsonl")
    launches = [_launch(record, job, main_pids[record["pod"]]) for record in called]
    silent = [pod.name for pod in job.pods if not any(l.pod == pod.name for l in launches)]
    return Reading(job, launches, silent, shell_errors)


def _launch(record: dict, job: jobs.Job, main_pid: int) -> Launch:
    pod = next(p for p in job.pods if p.name == record["pod"])
    argv, env = record["argv"], record["env"]
    tool = record["tool"]
    if tool != "torchrun" and argv[:2] == ["-m", "torch.distributed.run"]:
        tool, argv = "torchrun", argv[2:]
    # The tools exec all the way down, so the call has the pod's first pid only if the
    # pod's shell exec'd it: then the SIGTERM Kubernetes sends to that pid reaches it.
    execs = record["pid"] == main_pid
    launch = Launch(pod.name, "torchrun" if tool == "torchrun" else "python", argv, env,
                    execs=execs, literal_exec=_says_exec(pod.command, tool))
    if launch.tool == "torchrun":
        _parse_torchrun(launch, pod)
    else:
        launch.script = next((a for a in argv if not a.startswith("-")), None)
    return launch


def _says_exec(command: list[str], tool: str) -> bool:
    text = " ".join(command)
    return f"exec {tool}" in text or "exec python3 -m torch.distributed.run" in text


def _parse_torchrun(launch: Launch, pod: jobs.Pod) -> None:
    """Fill ``launch`` as torchrun would read its arguments in that pod (its parser takes each
    default from PET_<OPTION> at the time it is built, so it is built under the pod's env)."""
    from torch.distributed import run as torchrun

    wanted = {k: v for k, v in launch.environment.items() if k.startswith(("PET_", "TORCH"))}
    with mock.patch.dict(os.environ, wanted, clear=False):
        for key in [k for k in os.environ if k.startswith("PET_") and k not in wanted]:
            os.environ.pop(key)
        parser = torchrun.get_args_parser()
        parser.prog, parser.exit = "torchrun", _refuse
        try:
            args = parser.parse_args(launch.argv)
            low, high = torchrun.parse_min_max_nnodes(args.nnodes)
        except _Refused as refused:
            launch.error = str(refused)
            return
        except ValueError as error:
            launch.error = f"--nnodes {args.nnodes!r}: {error}"
            return
    launch.script = args.training_script
    launch.standalone = bool(args.standalone)
    launch.nnodes = (low, high)
    launch.nproc = _processes(args.nproc_per_node, pod.gpus)
    launch.node_rank = args.node_rank
    launch.backend = "c10d" if args.standalone else args.rdzv_backend
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint
                           and args.master_port is None and high == 1):
        launch.meeting, launch.own_loopback = (launch.pod, "own"), False
        launch.standalone = True
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint:
        launch.meeting = (args.master_addr, str(args.master_port or DEFAULT_MASTER_PORT))
    else:
        host, _, port = args.rdzv_endpoint.rpartition(":") if ":" in args.rdzv_endpoint \
            else (args.rdzv_endpoint, "", "29400")
        launch.meeting = (host, port)
    if launch.meeting[0] in LOOPBACK and not launch.standalone:
        launch.meeting, launch.own_loopback = (launch.pod, launch.meeting[1]), True
    if args.shutdown_timeout is not None:
        launch.shutdown_timeout, launch.shutdown_from = args.shutdown_timeout, "--shutdown-timeout"
    elif "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in launch.environment:
        launch.shutdown_timeout = int(launch.environment["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        launch.shutdown_from = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def _processes(nproc: str, gpus: float) -> int:
    """torchrun's --nproc-per-node on a node with the pod's GPUs ('gpu'/'auto' count them)."""
    if nproc in ("gpu", "auto", "cuda"):
        return max(math.ceil(gpus), 0) or (os.cpu_count() or 1 if nproc == "auto" else 0)
    try:
        return int(nproc)
    except ValueError:
        return 0


class _Refused(Exception):
    pass


def _refuse(status=0, message=None):
    raise _Refused((message or "").strip() or f"torchrun's arguments were refused (status {status})")
