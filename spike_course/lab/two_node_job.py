"""The capstone check's harness: the learner's script as a job of two nodes on this machine.

The launcher starts two torchrun agents (``nodes=2``: a c10d rendezvous on localhost), one rank
each (or ``per_node``), so that RANK and LOCAL_RANK differ on the second node as they do on a
cluster (or, for a start that only records choices, the ranks with the agents' variables and no
agents). Every Python they start loads ``capstone_probe.py`` as its ``sitecustomize``,
after an import blocker: ``spike_course`` cannot be imported, as on the cluster. What the
ranks did comes back as :class:`Job`: their recorded events, and the launch's result.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..cluster_image import import_blocker
from .launcher import LaunchResult, launch as launch_ranks

NODES = 2
LAUNCH_TIMEOUT = 180  # seconds; gloo would wait 30 minutes in a collective another rank never joins
MODEL_CLASS = "DigitClassifier"  # the model class of single.py, whose forwards the probe records


@dataclass
class Job:
    """What one launch did: events by (rank, attempt), and the launch's result (output, exits)."""
    result: LaunchResult
    events: dict = field(default_factory=dict)
    folder: Path = Path(".")
    per_node: int = 1  # ranks per node (torchrun's --nproc-per-node)

    @property
    def timed_out(self) -> bool:
        return self.result.timed_out

    @property
    def failed(self) -> bool:
        return not self.result.ok

    @property
    def output(self) -> str:
        """Every line the agents and the ranks printed, a rank's lines together."""
        ranks = [line for rank in sorted(self.result.output) for line in self.result.output[rank]]
        return "\n".join(self.result.agent_output + ranks)

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


def launch(script, folder, args, *, data, max_restarts=0, probe_env=None, watch=None, per_node=1,
           agents=True) -> Job:
    """Run ``script`` with ``args`` as a job of NODES nodes of ``per_node`` ranks each, in ``folder``.
    ``watch(job)`` is called with what the ranks recorded so far, four times a second while
    the job runs: an exception it raises stops the job and comes out of here. ``agents=False``
    starts the ranks with the variables torchrun's agents would give them, but no agents (two
    fewer imports of torch), for a start that records choices and never restarts."""
    folder = Path(folder)
    calls = folder / "calls"
    calls.mkdir(parents=True, exist_ok=True)
    for old in calls.iterdir():
        old.unlink()
    # One thread per rank, as the replay uses: the same kernels give the same floats. CUDA
    # hidden: the comparison is exact on the CPU.
    env = dict(PYTHONPATH=str(_site(folder)), CAPSTONE_LOG=str(calls), CAPSTONE_DATA=str(data),
               CAPSTONE_MODEL=MODEL_CLASS, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **(probe_env or {}))
    result = launch_ranks(
        Path(script).resolve(), per_node, args, launcher="torchrun" if agents else "fresh", nodes=NODES,
        cwd=folder, env=env, timeout=LAUNCH_TIMEOUT, check=False, echo=False, progress=False,
        # An agent whose partner already left gives up after a minute, not torch's ten.
        **(dict(max_restarts=max_restarts, rdzv_conf="join_timeout=60") if agents else {}),
        watch=None if watch is None else lambda so_far: watch(_read(folder, so_far, per_node)))
    return _read(folder, result, per_node)


def _read(folder, result, per_node) -> Job:
    """The job as its files tell it now: complete event lines only, and an empty list for an
    attempt that has started but recorded nothing yet."""
    job = Job(result=result, folder=folder, per_node=per_node)
    for path in sorted((folder / "calls").glob("rank*_attempt*.jsonl")):
        rank, attempt = (int(x) for x in re.findall(r"\d+", path.stem))
        events = job.events.setdefault((rank, attempt), [])
        for line in path.read_text().splitlines(keepends=True):
            if line.endswith("\n"):  # a line still being written waits for the next look
                events.append(json.loads(line))
    return job
