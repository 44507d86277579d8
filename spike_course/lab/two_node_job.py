"""The capstone check's harness: the learner's script as a job of two nodes on this machine.

Two torchrun agents (``--nnodes=2``, a c10d rendezvous on localhost) start one rank each (or
``nproc_per_node``), so that RANK and LOCAL_RANK differ on the second node as they do on a
cluster. Every Python they start loads ``capstone_probe.py`` as its ``sitecustomize``,
after an import blocker: ``spike_course`` cannot be imported, as on the cluster. What the
ranks did comes back as :class:`Job`: their recorded events, outputs and exit codes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..cluster_image import import_blocker

NODES = 2
LAUNCH_TIMEOUT = 180  # seconds; gloo would wait 30 minutes in a collective another rank never joins
MODEL_CLASS = "DigitClassifier"  # the model class of single.py, whose forwards the probe records


@dataclass
class Job:
    """What one launch did: events by (rank, attempt), the agents' output, how it ended."""
    events: dict = field(default_factory=dict)
    output: str = ""
    returncodes: list = field(default_factory=list)
    timed_out: bool = False
    folder: Path = Path(".")
    per_node: int = 1  # ranks per node (torchrun's --nproc-per-node)

    def of(self, rank, attempt, kind=None) -> list[dict]:
        return [e for e in self.events.get((rank, attempt), []) if kind is None or e["kind"] == kind]

    def every(self, kind) -> list[dict]:
        return [e for events in self.events.values() for e in events if e["kind"] == kind]

    @property
    def attempts(self) -> list[int]:
        return sorted({attempt for _, attempt in self.events})

    def weights(self, rank, attempt):
        """The weights ``rank`` started ``attempt`` with (its first forward), or None."""
        import torch

        path = self.folder / "calls" / f"weights_rank{rank}_attempt{attempt}.pt"
        return torch.load(path) if path.exists() else None


def _site(folder: Path) -> Path:
    site = folder / "site"
    site.mkdir(exist_ok=True)
    blocker = import_blocker(["spike_course"], "is not installed on the cluster: the job must not "
                             "import spike_course (copy what you need into the script)")
    probe = (Path(__file__).parent / "capstone_probe.py").read_text()
    (site / "sitecustomize.py").write_text(blocker + "\n" + probe)
    return site


def launch(script, folder, args, *, data, max_restarts=0, probe_env=None, watch=None, per_node=1) -> Job:
    """Run ``script`` with ``args`` as a job of NODES nodes of ``per_node`` ranks each, in ``folder``.
    ``watch(job)`` is called with what the ranks recorded so far, four times a second while
    the job runs: an exception it raises stops the job and comes out of here."""
    from .launcher import free_port, stop_process_tree

    folder = Path(folder)
    calls = folder / "calls"
    calls.mkdir(parents=True, exist_ok=True)
    for old in calls.iterdir():
        old.unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPIKE_COURSE_", "PET_", "CAPSTONE_"))}
    # One thread per rank, as the replay uses: the same kernels give the same floats. CUDA
    # hidden: the comparison is exact on the CPU. A restarted round gets its own store
    # (chapter 07: pytorch issues 135712 and 167288).
    env.update(PYTHONPATH=str(_site(folder)), CAPSTONE_LOG=str(calls), CAPSTONE_DATA=str(data),
               CAPSTONE_MODEL=MODEL_CLASS, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **(probe_env or {}))
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc-per-node={per_node}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=capstone",
               # An agent whose partner already left gives up after a minute, not torch's ten.
               "--rdzv-conf=join_timeout=60",
               f"--max-restarts={max_restarts}", str(Path(script).resolve()), *map(str, args)]
    logs = [open(folder / f"node{n}.log", "w") for n in range(NODES)]
    agents = [subprocess.Popen(command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
              for log in logs]
    deadline, timed_out = time.monotonic() + LAUNCH_TIMEOUT, False
    try:
        while any(agent.poll() is None for agent in agents):
            if time.monotonic() > deadline:
                timed_out = True
                break
            if watch is not None:
                watch(_read(folder, agents, timed_out=False, per_node=per_node))
            time.sleep(0.25)
    finally:
        # torchrun puts its workers in their own session: stop the whole tree (a no-op once done).
        stop_process_tree(agents)
        for log in logs:
            log.close()
    return _read(folder, agents, timed_out, per_node)


def _read(folder, agents, timed_out, per_node) -> Job:
    """The job as its files tell it now: complete event lines only, and an empty list for an
    attempt that has started but recorded nothing yet."""
    job = Job(output="\n".join((folder / f"node{n}.log").read_text() for n in range(NODES)),
              returncodes=[agent.poll() for agent in agents], timed_out=timed_out, folder=folder,
              per_node=per_node)
    for path in sorted((folder / "calls").glob("rank*_attempt*.jsonl")):
        rank, attempt = (int(x) for x in re.findall(r"\d+", path.stem))
        events = job.events.setdefault((rank, attempt), [])
        for line in path.read_text().splitlines(keepends=True):
            if line.endswith("\n"):  # a line still being written waits for the next look
                events.append(json.loads(line))
    return job
