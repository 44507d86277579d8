"""What a rehearsal names: tables of ``Mistake(name, seen, message)`` over what it read or ran.

``LINE`` is judged on a :class:`~.reading.Reading` (what every pod would launch), ``RUN`` on a
:class:`~.running.Run` (what the processes did). Unlike an exercise's check, a rehearsal
reports every mistake it sees, not only the first: a job line can hold several.
"""

from __future__ import annotations

from ..mistakes import Mistake

FIX_MASTER = '--master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT"'


def _several(reading):
    return len(reading.job.pods) > 1


def _meetings(reading):
    return {run.meeting for run in reading.torchruns if not run.own_loopback}


def _static(reading):
    return [run for run in reading.torchruns if run.backend == "static" and not run.standalone]


def _elastic(reading):
    return [run for run in reading.torchruns if run.backend != "static" and not run.standalone]


def _why_loopback(reading):
    if not any("MASTER_ADDR" in run.environment for run in reading.torchruns):
        return ("a job without a master pod gets no MASTER_ADDR, so it must be elastic "
                "(--min-replicas/--max-replicas: the operator then injects the rendezvous endpoint), "
                "or keep the master pod.")
    return (f"torchrun reads PET_MASTER_ADDR, never MASTER_ADDR, and this operator "
            f"({reading.job.flavour}) does not inject it. Pass {FIX_MASTER} (the shell expands them "
            "in each pod; runai.torchrun_command(..., master=True) writes it).")


def _node_ranks_clash(reading):
    runs = _static(reading)
    return bool(runs) and sorted(run.node_rank for run in runs) != list(range(len(runs)))


def _pods_against_nnodes(reading):
    runs = [run for run in reading.torchruns if not run.standalone]
    if not runs:
        return None
    low, high = runs[0].nnodes
    if _static(reading) and len(runs) != high:
        return f"{len(runs)} pods start torchrun, which waits for --nnodes={high} nodes"
    if _elastic(reading) and len(runs) > high:
        return (f"{len(runs)} pods start torchrun, but --nnodes={low}:{high} admits at most {high}: "
                f"{len(runs) - high} pod(s) wait outside the job, holding their GPUs")
    if _elastic(reading) and len(runs) < low:
        return f"{len(runs)} pods start torchrun, fewer than --nnodes={low}:{high} needs to begin"
    return None


def _shutdown_short(reading):
    return [run for run in reading.torchruns if run.shutdown_timeout < reading.job.grace]


def _not_exec(reading):
    return [run for run in reading.torchruns if not run.execs]


def _master_missing(reading):
    """The command passes $MASTER_ADDR, but the job has no master pod to inject it."""
    return "MASTER_ADDR" in " ".join(" ".join(pod.command) for pod in reading.job.pods) and not any(
        "MASTER_ADDR" in pod.env({p.name: p.name for p in reading.job.pods}, 0) for pod in reading.job.pods)


LINE = [
    Mistake("no-master-address",
            _master_missing,
            "the command passes $MASTER_ADDR, but a job without a master pod (--no-master) gets no "
            "MASTER_ADDR: keep the master pod, or make the job elastic (--min-replicas/--max-replicas) "
            "and leave the master flags out."),
    Mistake("pod-launches-nothing",
            lambda r: bool(r.silent_pods),
            lambda r: f"{', '.join(r.silent_pods)} started neither torchrun nor python"
                      + "".join(f"; its shell said: {r.shell_errors[p][-300:]}" for p in r.silent_pods
                                if p in r.shell_errors)),
    Mistake("torchrun-refused",
            lambda r: any(l.error for l in r.launches),
            lambda r: "; ".join(f"torchrun in {l.pod} refused its arguments: {l.error}"
                                for l in r.launches if l.error)),
    Mistake("no-torchrun-several-pods",
            lambda r: _several(r) and r.launches and not r.torchruns,
            "several pods each start `python` without torchrun: nothing tells them of each "
            "other, so each runs alone. Start `torchrun` in every pod."),
    Mistake("standalone-several-pods",
            lambda r: _several(r) and any(run.standalone for run in r.torchruns),
            "torchrun --standalone makes every pod a job of its own (it meets only itself): "
            "drop --standalone in a job of several pods."),
    Mistake("own-loopback",
            lambda r: _several(r) and any(run.own_loopback for run in r.torchruns),
            lambda r: "torchrun in " + ", ".join(run.pod for run in r.torchruns if run.own_loopback)
                      + " rendezvouses on its own 127.0.0.1, so the pods never meet: " + _why_loopback(r)),
    Mistake("meeting-points-differ",
            lambda r: len(_meetings(r)) > 1,
            lambda r: "the pods meet at different places: " + ", ".join(
                f"{run.pod} at {run.meeting[0]}:{run.meeting[1]}" for run in r.torchruns)),
    Mistake("node-ranks-clash",
            _node_ranks_clash,
            lambda r: "each pod needs its own --node-rank, 0 to nnodes-1; they have "
                      + ", ".join(f"{run.pod}: {run.node_rank}" for run in _static(r))
                      + " (the operator injects PET_NODE_RANK: do not pass --node-rank yourself)"),
    Mistake("pods-against-nnodes",
            lambda r: _pods_against_nnodes(r) is not None,
            lambda r: _pods_against_nnodes(r) + ". With a master pod, --workers N runs N + 1 pods."),
    Mistake("no-processes",
            lambda r: any(run.nproc < 1 for run in r.torchruns),
            "torchrun would start no process: --nproc-per-node=gpu on a pod without GPUs. Request "
            "GPUs, or give a number."),
    Mistake("torchrun-not-exec",
            lambda r: bool(_not_exec(r)),
            lambda r: "in " + ", ".join(run.pod for run in _not_exec(r)) + " the shell does not hand "
                      "its process over to torchrun (it is not the last command, or it runs in a "
                      "pipe or subshell): Kubernetes' SIGTERM goes to the shell, torchrun never "
                      "forwards it, and the ranks are killed at the end of the grace period without "
                      "their final save. Start it with `exec torchrun ...`, last."),
    Mistake("shutdown-before-grace",
            lambda r: bool(_shutdown_short(r)),
            lambda r: f"torchrun's agent SIGKILLs its ranks {_shutdown_short(r)[0].shutdown_timeout} s "
                      f"after it forwards SIGTERM ({_shutdown_short(r)[0].shutdown_from}), while the "
                      f"pod's grace period is {r.job.grace:g} s: a final save longer than that is "
                      f"killed. Pass --shutdown-timeout={int(r.job.grace)} to torchrun."),
]

# Advice: true of a line that works here, but fragile on another image or after an edit.
ADVICE = [
    Mistake("exec-implicit",
            lambda r: any(run.execs and not run.literal_exec for run in r.torchruns),
            "torchrun receives SIGTERM only because bash execs the last command of `bash -lc` "
            "(bash 5.1 and later, and only while it stays last): write `exec torchrun ...`."),
    Mistake("operator-world-size",
            lambda r: any("WORLD_SIZE" in l.environment for l in r.launches)
                      and r.torchruns and r.world_size != len(r.job.pods),
            lambda r: f"the operator's WORLD_SIZE is {len(r.job.pods)} (pods), torchrun's is "
                      f"{r.world_size} (processes): read WORLD_SIZE only inside the ranks."),
]


def seen(table, *readings) -> list[tuple[str, str]]:
    """(name, message) of every mistake in ``table`` that ``readings`` show."""
    return [(m.name, m.text(*readings)) for m in table if m.seen(*readings)]


# ---- what the processes did (a Run) ----

RESULT_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors", ".distcp", ".metadata", ".json", ".csv",
                   ".npz", ".npy", ".txt", ".log")


def _expected_world(run):
    return run.reading.world_size


def _ranks_wrong(run):
    ranks = run.ranks
    if not ranks:
        return None
    worlds = {p.environment.get("WORLD_SIZE") for p in ranks}
    expected = _expected_world(run)
    numbers = sorted(p.rank for p in ranks)
    if worlds != {str(expected)} or numbers != list(range(expected)):
        return (f"the line means {expected} ranks (0 to {expected - 1}); the processes saw ranks "
                f"{numbers} with WORLD_SIZE {sorted(worlds)}")
    return None


def _pods_without_ranks(run):
    if not run.ranks:
        return []
    return [pod.name for pod in run.reading.job.pods if not any(p.pod == pod.name for p in run.ranks)]


def _failed_pods(run):
    return [name for name, code in run.exit_codes.items()
            if code != 0 and run.sigterm_at is None and not run.timed_out]


def _preempted(run):
    return run.sigterm_at is not None


def _agents_without_sigterm(run):
    return [p for p in run.processes if p.agent and p.sigterm is None
            and (p.gone is None or run.seconds(p.gone) > run.sigterm_at)]


def _killed_by_agent(run):
    """Ranks that got SIGTERM, did not exit on their own, and were gone before the grace period
    ended: their agent SIGKILLed them at its shutdown timeout."""
    return [p for p in run.ranks if p.sigterm is not None and p.exited is None and p.gone is not None
            and (run.killed_at is None or run.seconds(p.gone) < run.killed_at - 0.5)]


def _agent_deadline(run):
    runs = run.reading.torchruns
    if not runs:
        return "its shutdown timeout is shorter than the save"
    return f"its shutdown timeout is {runs[0].shutdown_timeout} s ({runs[0].shutdown_from})"


def _killed_at_grace(run):
    return [p for p in run.processes if p.exited is None and p.gone is not None and run.killed_at
            and run.seconds(p.gone) >= run.killed_at - 0.05 and not run.timed_out]


def _final_save_lost(run):
    checkpoint = run.checkpoint
    return checkpoint is None or checkpoint["written"] < run.sigterm_at or not checkpoint["loads"]


def _rank_writes(run):
    """(rank, path) of every result file a rank wrote."""
    return [(p.rank, path) for p in run.ranks for _, path in p.writes
            if path.endswith(RESULT_SUFFIXES)]


def _outside_volume(run):
    if run.reading.job.mount is None:
        return []
    volume = str(run.volume)
    return sorted({path for _, path in _rank_writes(run) if not path.startswith(volume)})


def _shared_files(run):
    writers = {}
    for rank, path in _rank_writes(run):
        writers.setdefault(path, set()).add(rank)
    return {path: sorted(ranks) for path, ranks in writers.items() if len(ranks) > 1}


RUN = [
    Mistake("timed-out",
            lambda run: run.timed_out,
            lambda run: f"the job was still running after {run.killed_at:.0f} s and was killed: "
                        "did every pod join? (see each pod's output)"),
    Mistake("pod-never-joined",
            lambda run: bool(_pods_without_ranks(run)),
            lambda run: f"{', '.join(_pods_without_ranks(run))} started no rank: its torchrun never "
                        "joined the others"),
    Mistake("ranks-wrong",
            lambda run: _ranks_wrong(run) is not None,
            _ranks_wrong),
    Mistake("pod-failed",
            lambda run: bool(_failed_pods(run)),
            lambda run: "failed: " + ", ".join(f"{name} (exit {run.exit_codes[name]})"
                                                for name in _failed_pods(run))),
    Mistake("sigterm-missed-torchrun",
            lambda run: _preempted(run) and bool(_agents_without_sigterm(run)),
            lambda run: "Kubernetes' SIGTERM never reached torchrun in "
                        + ", ".join(sorted({p.pod for p in _agents_without_sigterm(run)}))
                        + ": the shell kept it (start it with `exec torchrun`), so its ranks got "
                        "no chance to save"),
    Mistake("killed-by-agent",
            lambda run: _preempted(run) and bool(_killed_by_agent(run)),
            lambda run: f"torchrun's agent SIGKILLed rank(s) {[p.rank for p in _killed_by_agent(run)]} "
                        f"{min(run.seconds(p.gone) for p in _killed_by_agent(run)) - run.sigterm_at:.0f} s "
                        f"after the SIGTERM, before the pod's {run.reading.job.grace:g} s grace period "
                        f"ended: {_agent_deadline(run)}. Pass --shutdown-timeout={int(run.reading.job.grace)} "
                        "to torchrun"),
    Mistake("killed-at-grace",
            lambda run: _preempted(run) and bool(_killed_at_grace(run)),
            lambda run: f"{len(_killed_at_grace(run))} process(es) still ran when the grace period "
                        f"ended ({run.reading.job.grace:g} s after the SIGTERM) and were SIGKILLed: "
                        "stop and save sooner, or ask for a longer grace period"),
    Mistake("final-save-lost",
            lambda run: _preempted(run) and _final_save_lost(run),
            lambda run: "no checkpoint that loads was completed after the SIGTERM"
                        + (f": the last is {run.checkpoint['path']} from {run.checkpoint['written']:.1f} s"
                           if run.checkpoint else ": the job left none")
                        + ", so the steps since then are lost"),
    Mistake("last-checkpoint-broken",
            lambda run: run.checkpoint is not None and not run.checkpoint["loads"],
            lambda run: f"the last checkpoint, {run.checkpoint['path']}, does not load "
                        f"({run.checkpoint['error']}): write to a temporary name and rename it into "
                        "place, so that a cut save never replaces a whole one"),
    Mistake("writes-outside-volume",
            lambda run: bool(_outside_volume(run)),
            lambda run: "written outside the volume, lost when the pod ends: "
                        + ", ".join(run.shown(path) for path in _outside_volume(run)[:3])),
    Mistake("same-file-many-ranks",
            lambda run: bool(_shared_files(run)),
            lambda run: "; ".join(f"{run.shown(path)} written by ranks {ranks}"
                                  for path, ranks in list(_shared_files(run).items())[:3])
                        + ": let one rank write a whole file (or use a distributed checkpoint)"),
]
