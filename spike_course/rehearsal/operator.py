"""What the Kubeflow training operator injects into each pod of a PyTorch job: one table, its source.

Run:ai's ``runai training pytorch submit`` creates a PyTorchJob (``kubeflow.org/v1``), and the
training operator sets the environment of each of its pods. Read from the operator's source:

* ``pkg/controller.v1/pytorch/envvar.go`` (``setPodEnv``): with a master replica, MASTER_ADDR,
  MASTER_PORT, WORLD_SIZE (replicas x ``nprocPerNode``, or replicas when that is ``auto``,
  its default), RANK (the pod's index: master 0, worker i is i + 1), PET_NPROC_PER_NODE (the
  job's ``nprocPerNode``, ``auto`` unless set) and PET_NODE_RANK (= RANK); PET_NNODES (the
  number of replicas) when the job is not elastic; PYTHONUNBUFFERED always.
* ``pkg/controller.v1/pytorch/elastic.go``: with an elastic policy, PET_RDZV_ENDPOINT
  (``<job>-worker-0:<port>``), PET_RDZV_BACKEND (c10d), PET_NNODES (``MIN:MAX``) and, when the
  policy sets them, PET_MAX_RESTARTS and PET_RDZV_ID.
* ``pkg/controller.v1/pytorch/master.go``: MASTER_ADDR is ``<job>-master-0``; newer releases
  also inject PET_MASTER_ADDR and PET_MASTER_PORT (same values), older ones (1.7 and its
  neighbours) do not. The default port of the container is 23456.

torchrun takes every option's default from ``PET_<OPTION>`` (``torch.distributed.argparse_util``)
and never reads MASTER_ADDR: under an older operator a plain ``torchrun train.py`` in a
non-elastic multi-pod job rendezvouses on 127.0.0.1, which is a different machine in every pod.
Both flavours are rehearsed; a line must work under both.
"""

from __future__ import annotations

DEFAULT_PORT = 23456  # the PyTorchJob container's default port (kubeflow.org/v1 defaults)

# The two operator releases a course line must work under.
FLAVOURS = {
    "older": "training-operator without PET_MASTER_ADDR/PET_MASTER_PORT (1.7 and its neighbours)",
    "newer": "training-operator that also injects PET_MASTER_ADDR/PET_MASTER_PORT (master.go today)",
}

# variable -> (its value, when it is there, source file in kubeflow/training-operator)
OPERATOR_ENV = {
    "MASTER_ADDR": ("address of the master pod (<job>-master-0)", "with a master pod",
                    "pytorch/master.go"),
    "MASTER_PORT": ("port on that pod (23456 unless the job sets another)", "with a master pod",
                    "pytorch/master.go"),
    "PET_MASTER_ADDR": ("the same as MASTER_ADDR: torchrun's --master-addr",
                        "with a master pod, NEWER releases only", "pytorch/master.go"),
    "PET_MASTER_PORT": ("the same as MASTER_PORT: torchrun's --master-port",
                        "with a master pod, NEWER releases only", "pytorch/master.go"),
    "WORLD_SIZE": ("pods x nprocPerNode; pods alone when nprocPerNode is 'auto' (its default, and "
                   "what a Run:ai line gets): NOT torchrun's WORLD_SIZE", "with a master pod",
                   "pytorch/envvar.go"),
    "RANK": ("index of this POD (master 0, workers 1..N), not of a process", "with a master pod",
             "pytorch/envvar.go"),
    "PET_NPROC_PER_NODE": ("torchrun --nproc-per-node: the job's nprocPerNode, 'auto' unless set",
                           "with a master pod", "pytorch/envvar.go"),
    "PET_NODE_RANK": ("torchrun --node-rank: the same index as RANK", "with a master pod",
                      "pytorch/envvar.go"),
    "PET_NNODES": ("torchrun --nnodes: the number of pods, or MIN:MAX for an elastic job", "always",
                   "pytorch/envvar.go, pytorch/elastic.go"),
    "PET_RDZV_BACKEND": ("torchrun --rdzv-backend (c10d)", "elastic jobs only", "pytorch/elastic.go"),
    "PET_RDZV_ENDPOINT": ("torchrun --rdzv-endpoint (<job>-worker-0:<port>)", "elastic jobs only",
                          "pytorch/elastic.go"),
    "PET_RDZV_ID": ("torchrun --rdzv-id", "elastic jobs only, if the policy sets it", "pytorch/elastic.go"),
    "PET_MAX_RESTARTS": ("torchrun --max-restarts", "elastic jobs only, if the policy sets it",
                         "pytorch/elastic.go"),
    "PYTHONUNBUFFERED": ("0", "always", "pytorch/envvar.go"),
}


def pod_names(job: str, workers: int, master: bool) -> list[str]:
    """The pods of a PyTorchJob in the order of their RANK: master first, then the workers."""
    return ([f"{job}-master-0"] if master else []) + [f"{job}-worker-{i}" for i in range(workers)]


def injected(index: int, pods: list[str], *, master: bool, elastic: tuple | None, flavour: str,
             hosts: dict, port: int) -> dict:
    """The environment the operator gives pod ``pods[index]``.

    elastic: None, or (min, max, max_restarts or None). hosts: pod name -> the address that
    stands in for it (the pod's own name when nothing runs). port: MASTER_PORT and the
    rendezvous port."""
    if flavour not in FLAVOURS:
        raise ValueError(f"unknown operator flavour {flavour!r}: use one of {sorted(FLAVOURS)}")
    env = {"PYTHONUNBUFFERED": "0"}
    if master:
        address = hosts[pods[0]]
        env.update(MASTER_ADDR=address, MASTER_PORT=str(port), WORLD_SIZE=str(len(pods)),
                   RANK=str(index), PET_NPROC_PER_NODE="auto", PET_NODE_RANK=str(index))
        if flavour == "newer":
            env.update(PET_MASTER_ADDR=address, PET_MASTER_PORT=str(port))
    if elastic is None:
        env["PET_NNODES"] = str(len(pods))
    else:
        low, high, restarts = elastic
        first_worker = pods[1] if master else pods[0]
        env.update(PET_RDZV_ENDPOINT=f"{hosts[first_worker]}:{port}", PET_RDZV_BACKEND="c10d",
                   PET_NNODES=f"{low}:{high}")
        if restarts is not None:
            env["PET_MAX_RESTARTS"] = str(restarts)
    return env
