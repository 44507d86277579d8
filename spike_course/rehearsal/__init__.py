"""Rehearse a cluster job on this machine before submitting it.

``read(line)`` says what every pod of a ``runai`` line (or a bare torchrun command) would
launch, without running it; ``rehearse(line, volume=..., preempt_at=...)`` runs its pods here
as the cluster would (the operator's environment, no GPU, hosts mapped to loopback, the volume
copied), preempts them if asked, and checks the last checkpoint. ``report`` formats either in
one screen; every mistake has a name (``mistakes``). ``spike-course rehearse`` is the same
from a terminal.
"""

from .jobs import read_job
from .reading import read
from .report import line_report, mistakes, run_report
from .running import rehearse

__all__ = ["read", "read_job", "ready", "rehearse", "line_report", "run_report", "mistakes"]


def ready(line: str) -> str:
    """The line read under both operator flavours: its report when neither shows a mistake,
    else a ValueError that names every one (what a notebook calls after printing a line)."""
    reports, names = [], []
    for flavour in ("older", "newer"):
        reading = read(line, flavour)
        reports.append(line_report(reading))
        names += [f"{name} (operator {flavour})" for name in mistakes(reading)]
    if names:
        raise ValueError("the line would fail on the cluster: " + ", ".join(names) + "\n"
                         + "\n".join(reports))
    return reports[0] + "\n(read under the newer operator too: no mistake)"
