"""Build ``runai`` submit command lines (single node, distributed, elastic) from a few settings.

Nothing here talks to a cluster: :func:`submit_command` returns the command line as one
shell-quoted string that you paste into a terminal where the ``runai`` CLI is logged in,
and :func:`describe` says what each flag of such a line means and which field of the
Run:ai web form it fills in.

Two kinds of job:

* one pod (one node), ``gpus`` GPUs in it: ``runai training submit ... --gpu-devices-request 4``.
  The command usually is ``torchrun --standalone --nproc-per-node=4 train.py`` (or a script
  that uses ``torch.multiprocessing.spawn``).
* one PyTorch job of several pods: ``runai training pytorch submit ... --workers 16``,
  elastic when ``min_replicas``/``max_replicas`` are given. ``--workers`` counts the worker
  pods; unless ``--no-master`` is given, Run:ai adds a master pod, so ``--workers N`` runs
  N + 1 pods. The training operator then injects ``PET_*`` environment variables, which
  ``torchrun`` reads as the defaults of its options (see :data:`OPERATOR_ENV`).
"""

from __future__ import annotations

import re
import shlex

from .rehearsal import operator
from .runtime import BACKENDS as PROCESS_GROUP_BACKENDS

# What the Kubeflow training operator injects into each pod, and when: one table, with its
# source, in the rehearsal (which injects exactly that when it runs a line here).
OPERATOR_ENV = {name: f"{value}; {when}" for name, (value, when, _) in operator.OPERATOR_ENV.items()}

# flag -> (what it means, where it is in the Run:ai UI's "new training" form)
FLAGS = {
    "-i": ("container image the pod runs", "Environment: image URL"),
    "-p": ("Run:ai project (its GPU quota is charged)", "Projects: the project you select first"),
    "--existing-pvc": ("mount an existing persistent volume claim at a path", "Data sources: PVC"),
    "--user-group-source": ("which user and group ids the container runs as",
                            "Environment: user / group source"),
    "--cpu-core-request": ("CPU cores guaranteed to the pod", "Compute resource: CPU request"),
    "--cpu-core-limit": ("CPU cores the pod may use at most", "Compute resource: CPU limit"),
    "--cpu-memory-request": ("memory guaranteed to the pod", "Compute resource: CPU memory request"),
    "--cpu-memory-limit": ("memory beyond which the pod is killed (OOM)",
                           "Compute resource: CPU memory limit"),
    "--gpu-devices-request": ("whole GPUs per pod", "Compute resource: GPU devices per pod"),
    "--gpu-request-type": ("whole devices or a portion of one GPU", "Compute resource: GPU fraction"),
    "--gpu-portion-request": ("fraction of one GPU (memory share) per pod",
                              "Compute resource: GPU fraction"),
    "--workers": ("worker pods of a distributed job; a master pod comes on top unless --no-master",
                  "Distributed: framework PyTorch, number of workers"),
    "--min-replicas": ("elastic: fewest pods the job runs with",
                       "Distributed: elastic, minimum replicas"),
    "--max-replicas": ("elastic: most pods the job grows to", "Distributed: elastic, maximum replicas"),
    "-e": ("an environment variable set in the container", "Environment: environment variables"),
    "--no-master": ("no master pod: the job runs exactly --workers pods (what an elastic job "
                    "wants)", "Distributed: master and workers / workers only"),
    "--preemptibility": ("preemptible: any higher-priority workload may stop it, in return it may "
                         "run beyond the project's quota", "General: preemptibility"),
    "--termination-grace-period": ("seconds between SIGTERM and SIGKILL when a pod is stopped or "
                                   "preempted (the pods' terminationGracePeriodSeconds)",
                                   "Runtime settings: termination grace period"),
    "--command": ("what follows `--` replaces the image's entry point",
                  "Runtime settings: command and arguments"),
}

_SWITCHES = {"--no-master"}   # flags without a value
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_MEMORY = re.compile(r"^\d+(\.\d+)?([KMGT]i?)?$")


def submit_command(name: str, image: str, project: str, command=None, gpus: float = 1,
                   workers: int | None = None, min_replicas: int | None = None,
                   max_replicas: int | None = None, pvc: str | None = None,
                   pvc_path: str = "/data", cpu: float | None = None, memory: str | None = None,
                   cpu_limit: float | None = None, memory_limit: str | None = None,
                   user_group_source: str | None = "fromTheImage", backend: str | None = "nccl",
                   env: dict | None = None, grace_period: int | None = None,
                   master: bool = True, preemptible: bool | None = None, extra=()) -> str:
    """The ``runai`` command line that submits this job, as one shell-quoted string.

    command: a string runs through ``bash -lc`` (so ``cd /data; python3 x.py`` works); a list
        is passed as separate arguments. None keeps the image's own entry point.
    gpus: whole GPUs per pod (``--gpu-devices-request``), or a fraction below 1
        (``--gpu-request-type portion --gpu-portion-request``); 0 for a CPU-only pod.
    workers: makes it a distributed PyTorch job with that many worker pods (Run:ai adds a
        master pod unless ``master=False``); ``min_replicas`` and
        ``max_replicas`` make it elastic (the job runs with anything between them).
    pvc: name of an existing claim, mounted at ``pvc_path``.
    cpu, memory: requests (``7``, ``"64G"``); the limits default to the same values, so
        the pod gets exactly what it asked for and is never throttled below it.
    backend: what the script's process group uses, only to catch impossible jobs
        (NCCL needs a GPU per process); None when the job does no torch.distributed.
    env: environment variables for the container (``-e KEY=VALUE``).
    master: with workers, whether Run:ai adds a master pod (``--workers N`` then runs N + 1
        pods); False passes ``--no-master``, which an elastic job wants: every pod is a worker
        and ``--max-replicas`` counts them all.
    preemptible: ``--preemptibility preemptible`` (may be stopped for any higher-priority
        workload, may run beyond quota) or ``non-preemptible``; None keeps the project's default.
    grace_period: whole seconds a pod gets between SIGTERM and SIGKILL when it is stopped or
        preempted (``--termination-grace-period``); None keeps the cluster's default (30 s in
        Kubernetes). Ask for one training step plus one checkpoint save, with a margin.
    extra: further flags, appended as given.
    """
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > 63:
        raise ValueError(f"workload name {name!r} is not a Kubernetes name: use at most 63 "
                         "lowercase letters, digits and '-', starting with a letter")
    for label, value in (("image", image), ("project", project)):
        if not value or not isinstance(value, str):
            raise ValueError(f"{label} must be a non-empty string, got {value!r}")
    if backend is not None and backend not in PROCESS_GROUP_BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use 'nccl', 'gloo' or None")
    if gpus is None or gpus < 0:
        raise ValueError(f"gpus must be >= 0, got {gpus!r}")
    if gpus > 1 and gpus != int(gpus):
        raise ValueError(f"gpus={gpus}: ask for whole GPUs, or for a fraction of one GPU (< 1)")
    if gpus == 0 and backend == "nccl":
        raise ValueError("gpus=0 with backend='nccl': NCCL runs one process per GPU and fails "
                         "without one. Request GPUs, or pass backend='gloo' for a CPU-only job "
                         "(backend=None if it uses no torch.distributed)")
    if command is not None and not isinstance(command, str) and not all(
            isinstance(part, str) for part in command):
        raise ValueError("command must be a string (run by bash -lc) or a list of strings")
    if isinstance(command, str) and not command.strip() or (command is not None and len(command) == 0):
        command = None

    elastic = min_replicas is not None or max_replicas is not None
    if workers is None and elastic:
        raise ValueError("min_replicas/max_replicas only make sense for a distributed job: "
                         "pass workers=N too")
    if workers is not None:
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"workers must be a whole number of pods >= 1, got {workers!r}")
        if command is None:
            raise ValueError("a distributed job (workers given) needs a command: every worker pod "
                             "must start torchrun on your script, e.g. "
                             "command='torchrun --nproc-per-node=1 train.py'")
        low = 1 if min_replicas is None else min_replicas
        high = workers if max_replicas is None else max_replicas
        if low < 1:
            raise ValueError(f"min_replicas must be >= 1, got {low}")
        if low > high:
            raise ValueError(f"min_replicas={low} > max_replicas={high}: an elastic job runs with "
                             "between min and max pods, so min must not exceed max")
        pods = workers + (1 if master else 0)
        if elastic and pods > high:
            raise ValueError(f"workers={workers} with a master pod runs {pods} pods, but an elastic "
                             f"job admits at most max_replicas={high} nodes: the last pod would wait "
                             "outside the job, holding its GPUs. Pass master=False (every pod a "
                             "worker) or raise max_replicas")
        if not low <= workers <= high:
            raise ValueError(f"workers={workers} lies outside min_replicas..max_replicas = "
                             f"{low}..{high}: the job starts {workers} pods, so it must be allowed "
                             "to run with that many")
    for label, value in (("memory", memory), ("memory_limit", memory_limit)):
        if value is not None and not _MEMORY.match(str(value)):
            raise ValueError(f"{label}={value!r} is not a Kubernetes quantity like '64G' or '500Mi'")
    if grace_period is not None and (not isinstance(grace_period, int) or isinstance(grace_period, bool)
                                     or grace_period < 1):
        raise ValueError(f"grace_period={grace_period!r}: give whole seconds >= 1 (the time of one "
                         "training step plus one checkpoint save, with a margin), or None for the "
                         "cluster's default")
    cpu_limit = cpu if cpu_limit is None else cpu_limit
    memory_limit = memory if memory_limit is None else memory_limit
    if cpu is not None and cpu_limit is not None and cpu_limit < cpu:
        raise ValueError(f"cpu_limit={cpu_limit} < cpu={cpu}: a limit below the request can "
                         "never be scheduled")

    parts = ["runai", "training"]
    parts += ["pytorch", "submit"] if workers is not None else ["submit"]
    parts += [name, "-i", image, "-p", project]
    if pvc:
        parts += ["--existing-pvc", f"claimname={pvc},path={pvc_path}"]
    if user_group_source:
        parts += ["--user-group-source", user_group_source]
    if cpu is not None:
        parts += ["--cpu-core-limit", _num(cpu_limit), "--cpu-core-request", _num(cpu)]
    if memory is not None:
        parts += ["--cpu-memory-limit", str(memory_limit), "--cpu-memory-request", str(memory)]
    if 0 < gpus < 1:
        parts += ["--gpu-request-type", "portion", "--gpu-portion-request", _num(gpus)]
    elif gpus >= 1:
        parts += ["--gpu-devices-request", str(int(gpus))]
    if workers is not None:
        parts += ["--workers", str(workers)]
        if not master:
            parts += ["--no-master"]
        if min_replicas is not None:
            parts += ["--min-replicas", str(min_replicas)]
        if max_replicas is not None:
            parts += ["--max-replicas", str(max_replicas)]
    for key, value in (env or {}).items():
        parts += ["-e", f"{key}={value}"]
    if preemptible is not None:
        parts += ["--preemptibility", "preemptible" if preemptible else "non-preemptible"]
    if grace_period is not None:
        parts += ["--termination-grace-period", f"{grace_period}s"]
    parts += [str(flag) for flag in extra]
    if command is not None:
        parts += ["--command", "--"]
        parts += ["bash", "-lc", command] if isinstance(command, str) else list(command)
    return shlex.join(parts)


def torchrun_command(script: str, *args, nproc_per_node: int | str = "gpu", master: bool = False,
                     shutdown_timeout: int | None = None) -> str:
    """The command a pod runs: ``exec torchrun ...``.

    ``exec`` makes torchrun the container's first process, the one Kubernetes sends SIGTERM to
    (a shell that only runs it would keep the signal). The operator's ``PET_*`` variables give
    nnodes, the node rank and, for an elastic job, the rendezvous. master: a job of several
    pods WITH a master pod: torchrun reads PET_MASTER_ADDR, which older operators do not
    inject, never MASTER_ADDR, so the line passes MASTER_ADDR and MASTER_PORT itself (left for
    the pod's shell to expand). shutdown_timeout: seconds torchrun's agent gives its ranks
    after it forwards SIGTERM before it SIGKILLs them (30 unless set): give the pod's grace
    period, or a final save longer than 30 s is killed whatever the grace period.
    """
    parts = ["exec", "torchrun", f"--nproc-per-node={nproc_per_node}"]
    if shutdown_timeout is not None:
        if not isinstance(shutdown_timeout, int) or isinstance(shutdown_timeout, bool) or shutdown_timeout < 1:
            raise ValueError(f"shutdown_timeout={shutdown_timeout!r}: give whole seconds >= 1 (the "
                             "pod's grace period)")
        parts.append(f"--shutdown-timeout={shutdown_timeout}")
    meet = ' --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT"' if master else ""
    head, rest = shlex.join(parts), shlex.join([script, *[str(a) for a in args]])
    return f"{head}{meet} {rest}"


def describe(command_line: str) -> list[tuple[str, str, str, str]]:
    """Split a ``runai ... submit`` line into (flag, value, meaning, UI field) rows."""
    words = shlex.split(command_line)
    rows = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--command":
            rest = words[i + 2:] if i + 1 < len(words) and words[i + 1] == "--" else words[i + 1:]
            rows.append((word, shlex.join(rest), *FLAGS[word]))
            break
        if word in _SWITCHES:
            rows.append((word, "", *FLAGS[word]))
            i += 1
            continue
        if word in FLAGS:
            value = words[i + 1] if i + 1 < len(words) else ""
            rows.append((word, value, *FLAGS[word]))
            i += 2
            continue
        i += 1
    return rows


def _num(value) -> str:
    return str(int(value)) if float(value) == int(value) else str(value)
