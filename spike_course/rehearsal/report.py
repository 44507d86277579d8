"""The rehearsal's report, one screen: the pods, what each launched, what the ranks did, and
every mistake seen, each with its name (tests plant each by that name)."""

from __future__ import annotations

from . import findings


def line_report(reading) -> str:
    """What the line means and what each pod would launch (no job runs)."""
    job = reading.job
    out = [f"{job.kind}: {len(job.pods)} pod(s), grace period {job.grace:g} s, operator "
           f"flavour '{job.flavour}'" + (f", volume at {job.mount}" if job.mount else "")]
    launches = reading.launches
    shown = launches if len(launches) <= 4 else launches[:2] + launches[-1:]
    for launch in shown:
        if launch is launches[-1] and len(shown) < len(launches):
            out.append(f"  ... {len(launches) - 3} more pods like these ...")
        out.append(f"  {launch.pod}: " + _launched(launch))
    if reading.torchruns:
        out.append(f"  world size: {reading.world_size} rank(s)")
    out += _named(findings.seen(findings.LINE, reading), "mistake")
    out += _named(findings.seen(findings.ADVICE, reading), "advice")
    return "\n".join(out)


def run_report(run) -> str:
    """The line, then what the processes did."""
    from .running import CLUSTER_ONLY

    out = [line_report(run.reading)]
    if not run.ran:
        names = CLUSTER_ONLY & {name for name, _ in findings.seen(findings.LINE, run.reading)}
        out.append(f"not run: on the cluster these pods would never form one job ({', '.join(sorted(names))}), "
                   "and on this one machine they might. Fix the line first.")
        return "\n".join(out)
    out.append(f"ran {run.ended - run.began:.1f} s" + (f"; every rank joined at {run.ranks_up:.1f} s" if run.ranks_up is not None else "")
               + (f"; SIGTERM at {run.sigterm_at:.1f} s" if run.sigterm_at is not None else "")
               + (f"; SIGKILL at {run.killed_at:.1f} s" if run.killed_at is not None else ""))
    for process in run.ranks:
        wrote = sorted({run.shown(path) for _, path in process.writes
                        if path.endswith(findings.RESULT_SUFFIXES)})
        fate = _fate(run, process)
        out.append(f"  rank {process.rank} of {process.environment.get('WORLD_SIZE')} in {process.pod}: "
                   f"{fate}" + (f"; wrote {', '.join(wrote[:3])}" + (" ..." if len(wrote) > 3 else "") if wrote else ""))
    if run.checkpoint:
        c = run.checkpoint
        out.append(f"  last checkpoint: {c['path']} at {c['written']:.1f} s by ranks {c['by']}: "
                   + ("loads" if c["loads"] else f"does NOT load ({c['error']})"))
    error = first_error(run)
    if error:
        out.append(f"  first error ({error[0]}): {error[1]}")
    out += _named(findings.seen(findings.RUN, run), "mistake")
    return "\n".join(out)


def mistakes(run_or_reading) -> list[str]:
    """The names of every mistake the rehearsal saw."""
    reading = getattr(run_or_reading, "reading", run_or_reading)
    names = [name for name, _ in findings.seen(findings.LINE, reading)]
    if getattr(run_or_reading, "ran", False):
        names += [name for name, _ in findings.seen(findings.RUN, run_or_reading)]
    return names


def first_error(run) -> tuple[str, str] | None:
    """(pod, last line of its first traceback), in the order of the pods."""
    for pod, log in run.logs.items():
        lines = log.splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("Traceback (most recent call last)"):
                for later in lines[i + 1:]:
                    if later and not later.startswith((" ", "\t")) and not later.startswith("Traceback"):
                        # the agent's own SignalException is how it takes a SIGTERM, not an error
                        if not (run.sigterm_at is not None and "SignalException" in later):
                            return pod, later.strip()[:200]
                        break
    return None


def _fate(run, process) -> str:
    if process.exited is not None:
        return f"exited at {run.seconds(process.exited):.1f} s"
    if process.gone is not None:
        return f"killed at {run.seconds(process.gone):.1f} s"
    return "still running"


def _launched(launch) -> str:
    if launch.tool != "torchrun" or launch.error:
        return f"{launch.tool} {' '.join(launch.argv)[:70]}"
    meets = "itself (standalone)" if launch.standalone else \
        f"{launch.meeting[0]}:{launch.meeting[1]}" + (" (its own loopback)" if launch.own_loopback else "")
    rank = f", node rank {launch.node_rank}" if launch.backend == "static" and not launch.standalone else ""
    return (f"torchrun {launch.script}, {launch.nproc} process(es), nnodes {_nodes(launch.nnodes)}{rank}, "
            f"meets at {meets}, shutdown timeout {launch.shutdown_timeout} s"
            + ("" if launch.execs else ", NOT exec'd"))


def _nodes(nnodes) -> str:
    return str(nnodes[0]) if nnodes[0] == nnodes[1] else f"{nnodes[0]}:{nnodes[1]}"


def _named(seen, kind) -> list[str]:
    return [f"{kind} [{name}]: {message}" for name, message in seen]
