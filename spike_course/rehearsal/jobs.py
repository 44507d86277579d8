"""A job as a learner submits it, read into the pods the cluster would start.

Two forms: a ``runai training [pytorch] submit ...`` line (as ``spike_course.runai`` builds
it or a learner types it), and a bare command (``torchrun --standalone ...``: one node). Slurm
batch scripts are refused with a clear message (not rehearsed yet). Nothing runs here:
:func:`read_job` returns a :class:`Job`, whose pods say what each process group starts with
and which environment the operator (or Slurm) injects into it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Callable

from . import operator

KUBERNETES_GRACE = 30.0   # terminationGracePeriodSeconds unless the pod asks for another

# Run:ai flags that take a value and change nothing the rehearsal runs.
_VALUE_FLAGS = {"-i", "--image", "-p", "--project", "--user-group-source", "--cpu-core-request",
                "--cpu-core-limit", "--cpu-memory-request", "--cpu-memory-limit", "--gpu-request-type",
                "--gpu-memory-request", "--node-pools", "--node-type", "--priority", "--preemptibility",
                "--working-dir", "--run-as-uid", "--run-as-gid", "--label", "--annotation"}
_SWITCHES = {"--no-master", "--interactive", "--attach", "--large-shm", "--run-as-user"}


@dataclass
class Pod:
    """One pod (or Slurm task group): its name, the command its container runs, and the
    environment injected into it, made for given hosts (pod name -> address) and port."""
    name: str
    command: list[str]
    environment: Callable[[dict, int], dict]
    gpus: float = 0.0

    def env(self, hosts: dict, port: int) -> dict:
        return self.environment(hosts, port)


@dataclass
class Job:
    """What the cluster would run: the pods, the grace period, where the volume is mounted."""
    kind: str                       # "runai pytorch", "runai" or "command"
    name: str
    pods: list[Pod]
    grace: float                    # seconds between SIGTERM and SIGKILL
    mount: str | None = None        # the cluster path of the persistent volume (e.g. /data)
    flavour: str = "older"          # which operator release injects the environment
    notes: list[str] = field(default_factory=list)


def read_job(text: str, flavour: str = "older") -> Job:
    """The job a ``runai`` line or a bare command describes."""
    if flavour not in operator.FLAVOURS:
        raise ValueError(f"unknown operator flavour {flavour!r}: use one of {sorted(operator.FLAVOURS)}")
    stripped = text.strip()
    if not stripped:
        raise ValueError("no job given: pass a `runai training ... submit` line "
                         "or a torchrun command")
    if "#SBATCH" in stripped or stripped.startswith("#!") and "srun" in stripped:
        raise ValueError("this is a Slurm batch script: the rehearsal reads Run:ai lines and bare "
                         "torchrun commands only, so far. Rehearse the command srun starts on one node "
                         "(`spike-course rehearse 'torchrun --standalone ...'`)")
    words = shlex.split(stripped.replace("\\\n", " "))
    if words[:2] == ["runai", "training"] or words[:1] == ["runai"] and "submit" in words:
        return _read_runai(words, flavour)
    # as a learner types it in a terminal: a shell runs it
    return Job("command", "command", [Pod("node-0", ["bash", "-lc", stripped], lambda hosts, port: {}, gpus=0)],
               grace=KUBERNETES_GRACE, notes=["a bare command: rehearsed as one node"])


def _read_runai(words: list[str], flavour: str) -> Job:
    if "submit" not in words:
        raise ValueError("a runai line submits a workload: `runai training [pytorch] submit NAME ...`")
    at = words.index("submit")
    distributed = "pytorch" in words[:at]
    if at + 1 >= len(words) or words[at + 1].startswith("-"):
        raise ValueError("the workload's name must follow `submit`: runai training submit NAME ...")
    name, flags, command, notes = words[at + 1], {}, None, []
    i = at + 2
    while i < len(words):
        word = words[i]
        if word == "--command":
            command = words[i + 2:] if i + 1 < len(words) and words[i + 1] == "--" else words[i + 1:]
            break
        if word in _SWITCHES:
            flags[word] = True
            i += 1
            continue
        key, _, inline = word.partition("=")
        if inline or key in _VALUE_FLAGS or key.startswith("-"):
            value = inline if inline else (words[i + 1] if i + 1 < len(words) else "")
            flags.setdefault(key, []).append(value)
            i += 1 if inline else 2
            if key not in _VALUE_FLAGS and key not in _KNOWN:
                notes.append(f"{key}: not rehearsed (the rehearsal does not know what it does)")
            continue
        raise ValueError(f"{word!r} in the runai line: a flag was expected (the command goes after "
                         "`--command --`)")
    if not command:
        raise ValueError("the runai line has no `--command -- ...`: the rehearsal needs the command "
                         "the pods run (an image's own entry point cannot be rehearsed)")
    return _runai_job(name, distributed, flags, command, flavour, notes)


_KNOWN = {"--workers", "--min-replicas", "--max-replicas", "--gpu-devices-request",
          "--gpu-portion-request", "--existing-pvc", "-e", "--environment",
          "--termination-grace-period", "--max-restarts"}


def _runai_job(name, distributed, flags, command, flavour, notes) -> Job:
    gpus = _one_number(flags, "--gpu-devices-request") or _one_number(flags, "--gpu-portion-request") or 0
    extra = dict(_env_pair(pair) for pair in flags.get("-e", []) + flags.get("--environment", []))
    grace = _duration(flags["--termination-grace-period"][-1]) if "--termination-grace-period" in flags \
        else KUBERNETES_GRACE
    mount = None
    for spec in flags.get("--existing-pvc", []):
        mount = dict(part.split("=", 1) for part in spec.split(",") if "=" in part).get("path", mount)
    if not distributed:
        pods = [Pod(f"{name}-0", command, lambda hosts, port: dict(extra), gpus)]
        return Job("runai", name, pods, grace, mount, flavour, notes)
    workers = int(_one_number(flags, "--workers") or 1)
    master = "--no-master" not in flags
    low, high = _one_number(flags, "--min-replicas"), _one_number(flags, "--max-replicas")
    elastic = None
    if low is not None or high is not None:
        restarts = _one_number(flags, "--max-restarts")
        elastic = (int(low or 1), int(high or workers), None if restarts is None else int(restarts))
    names = operator.pod_names(name, workers, master)

    def environment_of(index):
        def environment(hosts, port):
            env = operator.injected(index, names, master=master, elastic=elastic, flavour=flavour,
                                    hosts=hosts, port=port)
            env.update(extra)
            return env
        return environment

    pods = [Pod(pod, command, environment_of(i), gpus) for i, pod in enumerate(names)]
    return Job("runai pytorch", name, pods, grace, mount, flavour, notes)


def _one_number(flags, key):
    values = flags.get(key)
    if not values:
        return None
    try:
        return float(values[-1])
    except ValueError:
        raise ValueError(f"{key} {values[-1]!r}: a number was expected") from None


def _env_pair(pair: str) -> tuple[str, str]:
    key, sep, value = pair.partition("=")
    if not sep or not key:
        raise ValueError(f"-e {pair!r}: write -e KEY=VALUE")
    return key, value


def _duration(text: str) -> float:
    """Seconds of a Kubernetes-style duration: 71s, 2m, 1m30s, 90."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s?)?", text.strip())
    if not text.strip() or parts is None:
        raise ValueError(f"--termination-grace-period {text!r}: write a duration like 71s or 2m")
    hours, minutes, seconds = (float(p) if p else 0.0 for p in parts.groups())
    return 3600 * hours + 60 * minutes + seconds
