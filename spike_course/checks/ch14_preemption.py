"""Exercise checks for chapter 14: a training job that survives preemption.

``check_preemption_safe`` runs the drill itself: it launches the learner's script, delivers
real signals (SIGTERM with a grace period, then SIGKILL, as Kubernetes does; SIGKILL with no
grace, as a lost node does) at random steps, relaunches the same command each time, and
compares every step the runs trained, and the final weights, bit for bit with the
uninterrupted run of the given plain script. Its ranks run under ``preemption_probe.py``, which
records each checkpoint save: the process group it used and the generator states it held, what
would fail on a GPU node although the drill passes on a laptop."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

from ._common import CheckFailed, Mistake, name_the_first, passed

GRACE = 3.0  # seconds between SIGTERM and SIGKILL: a step and a save of this job take milliseconds
PLANTED = "step_999999"  # the half-written folder the check leaves, as a SIGKILL mid-save would
PROBE = Path(__file__).parents[1] / "lab" / "preemption_probe.py"


def _async_saves(saves):
    return [s for s in saves if s["call"] == "async_save"]


# What the probe's readings of the saves (one dict per save, every rank) show.
SAVE_MISTAKES = (
    Mistake("async save on the default group",
            lambda saves: any(s.get("default_group") for s in _async_saves(saves)),
            "dcp.async_save ran on the default process group (no process_group given, or the default "
            "group): its collectives, in a background thread, then mix with the training's all-reduces "
            "on that group, and on a GPU node, where the default group is NCCL only, async_save stops at "
            "once (\"A CPU backend must be enabled for async save\"). Give the save a group of its own "
            "(Hint 4)."),
    Mistake("async save group without a CPU backend",
            lambda saves: any(s.get("cpu_backend") is False for s in _async_saves(saves)),
            "dcp.async_save ran on a process group without a CPU backend (a new group inherits the "
            "default group's backend: NCCL on a GPU node), and async_save asserts that its group has one "
            "(\"A CPU backend must be enabled for async save\"). Create the save's group with a CPU "
            "backend (Hint 4)."),
    Mistake("periodic saves block the training",
            lambda saves: any(s["call"] == "save" and not s.get("after_signal") and s is not mine[-1]
                              for mine in _by_rank(saves, main_thread=True).values() for s in mine),
            "a rank saved a periodic checkpoint (one before the drill's signal, and not its last) with "
            "dcp.save, which holds the training until its files are written: the statement asks for the "
            "periodic saves in the background while training goes on (Hint 4)."),
    Mistake("GPU generator not saved",
            lambda saves: any(s.get("device") == "cuda" and s.get("gpu_generator") is False for s in saves),
            "a checkpoint saved by a rank that computes on a GPU does not hold that GPU's random generator "
            "state: torch.get_rng_state() is the CPU generator's only, and dropout and randn_like of a CUDA "
            "tensor draw from the GPU's. A resumed run would draw other numbers. Hint 5."),
)


def _saves(log: Path, signalled_at: float | None = None) -> list[dict]:
    """The probe's readings of every save of one launch so far, all ranks, each with its rank
    and whether it came after the drill's signal (sent at ``signalled_at``, wall clock); a line
    still being written, without its newline, is left for the next reading."""
    readings = []
    for path in sorted(log.glob("rank*.jsonl")):
        for line in path.read_text().split("\n")[:-1]:
            reading = json.loads(line)
            after = signalled_at is not None and reading.get("time", 0.0) >= signalled_at
            readings.append({**reading, "rank": int(path.stem[len("rank"):]), "after_signal": after})
    return readings


def _by_rank(saves, main_thread=False) -> dict:
    """Each rank's saves, in order (with ``main_thread``, those its training thread made)."""
    found = {}
    for save in saves:
        if save.get("main_thread", True) or not main_thread:
            found.setdefault(save.get("rank", 0), []).append(save)
    return found


def _beats(folder: Path, nproc: int) -> dict:
    found = {}
    for rank in range(nproc):
        try:
            pid, step = map(int, (folder / f"rank{rank}").read_text().split())
            found[rank] = (pid, step)
        except (FileNotFoundError, ValueError):
            pass
    return found


class _Drill:
    """The drill, as the launch's watch: once every rank has reached ``at_step``, signal
    ``ranks``; GRACE s later SIGKILL the signalled ranks still alive (as the cluster would); a
    save the probe saw go wrong ends the launch at once (on a laptop a background save on the
    default group can hang the job until its timeout)."""

    def __init__(self, at_step, sig, ranks, nproc, beats_dir, log):
        self.at_step, self.sig, self.ranks, self.nproc, self.beats_dir, self.log = \
            at_step, sig, ranks, nproc, beats_dir, log
        self.sent = None  # (when, the beats then) once the signal went
        self.signalled_at, self.last, self.wrong, self.read_at = None, None, False, 0.0

    def __call__(self, _result):
        beats = _beats(self.beats_dir, self.nproc)
        if self.at_step is not None and self.sent is None and len(beats) == self.nproc \
                and min(s for _, s in beats.values()) >= self.at_step:
            self.sent, self.signalled_at = (time.monotonic(), beats), time.time()
            for rank in self.ranks:
                os.kill(beats[rank][0], self.sig)
        if self.sent and self.last is None and time.monotonic() - self.sent[0] > GRACE:
            self.last = _beats(self.beats_dir, self.nproc)  # the beats when the grace period ran out
            _kill(self.sent[1])
        if not self.wrong and time.monotonic() > self.read_at:
            self.read_at = time.monotonic() + 0.02
            saves = _saves(self.log, self.signalled_at)  # read once for every mistake of the table
            self.wrong = any(mistake.seen(saves) for mistake in SAVE_MISTAKES)
            if self.wrong:
                _kill(beats)


def _launch(script, args, at_step, sig, ranks, nproc, threads, work):
    """One launch with the drill: returns (job, beats when the signal went, beats at the end,
    whether the grace period ran out)."""
    import spike_course

    beats_dir, log = work / "heartbeat", work / "saves"
    for folder in (beats_dir, log):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    drill = _Drill(at_step, sig, ranks, nproc, beats_dir, log)
    job = spike_course.launch(
        PROBE, nproc=nproc, omp_threads=threads, check=False, echo=False, progress=False, timeout=60,
        args=[log, script, *args, "--ckpt-dir", work / "ckpt", "--heartbeat", beats_dir],
        watch=drill, watch_every=0.001)
    _not_written(job)
    name_the_first(SAVE_MISTAKES, _saves(log, drill.signalled_at))
    _started(job, "launch")
    if at_step is not None and drill.sent is None:
        raise CheckFailed(f"the job ended before it reached step {at_step}, so no signal could be sent: "
                          "it must train --steps steps and call parts.heartbeat(args, ctx, step) before each.")
    return job, (drill.sent[1] if drill.sent else None), drill.last, drill.last is not None


def _kill(beats: dict) -> None:
    for pid, _ in beats.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _not_written(job):
    failure = job.failure
    if failure is not None and failure.blank:
        raise CheckFailed("safe_train.py is not written yet: a rank stopped at `raise NotImplementedError`. "
                          "Replace that line with your code and run the check again.")


def _started(job, what):
    _not_written(job)
    if job.timed_out:
        raise CheckFailed(f"the {what} did not finish within {job.seconds:.0f} s: a rank waited in a collective "
                          "that the other never entered.")


class _Stop:
    """A launch that received SIGTERM (on ``ranks``): how its ranks ended, what they reported,
    and, if the grace period ran out (``killed``), the steps each had done then (``last``)."""

    def __init__(self, job, last, killed, ranks, what):
        self.job, self.last, self.killed, self.ranks, self.what = job, last, killed, ranks, what
        self.codes = job.returncodes
        self.reported = sorted(job.reports) == list(range(job.nproc))

    @property
    def unprepared(self) -> int | None:
        """The first signalled rank that SIGTERM ended at once, or None."""
        return next((r for r in self.ranks if self.codes.get(r) == -signal.SIGTERM), None)

    @property
    def steps_when_killed(self) -> dict:
        return {r: s for r, (_, s) in self.last.items()} if self.killed else {}

    @property
    def aborted(self) -> int | None:
        """The first rank that reported and then aborted its exit (SIGABRT), or None."""
        return next((r for r in range(self.job.nproc) if self.codes.get(r) == -signal.SIGABRT
                     and r in self.job.reports), None)

    @property
    def stops(self) -> dict:
        """rank -> (steps done, the signal it stopped on), as the ranks reported."""
        return {r: (rep["step"], rep["stopped"]) for r, rep in self.job.reports.items()}


NOT_AWAITED = ("a background save (dcp.async_save) that nobody waited for: its future must be done, and the save "
               "known to be complete, before the process ends (Hint 4).")

# How a launch ended after SIGTERM, in this order (readings: the stop).
STOP_MISTAKES = (
    Mistake("no handler", lambda t: t.unprepared is not None,
            lambda t: f"in the {t.what}, SIGTERM ended rank {t.unprepared} at once (exit code -15): nothing caught the "
                      "signal, so the job saved nothing. See Hint 1."),
    Mistake("a save never awaited, hung at exit", lambda t: t.killed and t.reported,
            lambda t: f"in the {t.what}, the ranks stopped after step {t.job.reports[0]['step']} and reported, but did "
                      f"not exit within the grace period of {GRACE:.0f} s and were killed: the processes hung at "
                      f"exit. That is where {NOT_AWAITED}"),
    Mistake("each rank decides alone", lambda t: t.killed and len(set(t.steps_when_killed.values())) > 1,
            lambda t: f"in the {t.what}, the ranks stopped at different steps ({t.steps_when_killed}, steps done per "
                      f"rank when the grace period of {GRACE:.0f} s ran out) and the job hung until SIGKILL: one rank "
                      "decided to stop by itself while the other went on into the next step's collectives. All ranks "
                      "must decide together, at the same step boundary (Hint 2)."),
    Mistake("saving inside the handler", lambda t: t.killed,
            lambda t: f"in the {t.what}, the job did not leave within the grace period of {GRACE:.0f} s after SIGTERM "
                      "and was killed, although every rank was at the same step: it hung inside a step. A save (or "
                      "any collective) started from the signal handler runs while the other rank is inside a training "
                      "collective. The handler may only record the signal (Hint 1)."),
    # it finished and reported: what aborted its exit was a thread still running
    Mistake("a save never awaited, aborted at exit", lambda t: t.aborted is not None,
            lambda t: f"in the {t.what}, rank {t.aborted} stopped and reported, then aborted as it exited (exit code "
                      "-6, SIGABRT): a background thread was still running when the process ended. That is "
                      f"{NOT_AWAITED}"),
)
# What the ranks reported once they all stopped (readings: the stop).
AGREEMENT_MISTAKES = (
    Mistake("rank 0 alone decides", lambda t: 0 not in t.ranks and all(sig == 0 for _, sig in t.stops.values()),
            lambda t: f"in the {t.what}, only rank {min(t.ranks)} received SIGTERM, and the job trained on to step "
                      f"{t.stops[0][0]} as if nothing had happened: the decision to stop ignored that rank's flag "
                      "(rank 0 alone decided?). Every rank's flag must count, and all ranks must learn the same "
                      "answer (Hint 2)."),
    Mistake("the ranks stop apart",
            lambda t: len({s for s, _ in t.stops.values()}) > 1
            or any(sig != signal.SIGTERM for _, sig in t.stops.values()),
            lambda t: f"in the {t.what}, the ranks reported (steps done, signal) = {t.stops}: every rank, also one "
                      "that received no signal itself, must stop at the same step and report stopped=SIGTERM "
                      "(Hint 2)."),
)


def _after_sigterm(job, last, killed, ranks, what):
    _started(job, what)
    t = _Stop(job, last, killed, ranks, what)
    name_the_first(STOP_MISTAKES, t)
    if not job.ok or not t.reported:
        failure = job.failure
        raise CheckFailed(f"in the {what}, rank {failure.rank} failed after SIGTERM (exit code {failure.code}): "
                          f"{failure.error}. The launch output shows its traceback.")
    name_the_first(AGREEMENT_MISTAKES, t)
    return t.stops[0][0]


# Where a relaunch resumed (readings: the step it started from, the step it should not start before, the launch).
RESUME_MISTAKES = (
    Mistake("a half-written checkpoint loaded", lambda start, expected_from, what: start == int(PLANTED.split("_")[1]),
            lambda start, expected_from, what: f"the {what} loaded {PLANTED}, a checkpoint folder whose save never "
                                               "finished (the check left it as a SIGKILL in the middle of a save "
                                               "would). Load only checkpoints known to be complete (Hint 3)."),
    Mistake("the last save lost", lambda start, expected_from, what: start < expected_from,
            lambda start, expected_from, what: f"the job stopped after step {expected_from} on SIGTERM, but the {what} "
                                               f"resumed from step {start}: the work of steps "
                                               f"{start + 1}..{expected_from} was lost. The save of the step the job "
                                               "stopped at must be finished, and known to be finished, before the "
                                               f"process exits; {NOT_AWAITED}"),
)


def _resumed(job, expected_from, what):
    name_the_first(RESUME_MISTAKES, job.reports[0]["start"], expected_from, what)


# A resumed step that is not the uninterrupted run's (readings: where, what it trained, what that run did).
STEP_MISTAKES = (
    Mistake("data position not saved", lambda where, got, want: got["samples"] != want["samples"],
            lambda where, got, want: f"{where} trained samples {got['samples'][:4]}..., the uninterrupted run "
                                     f"{want['samples'][:4]}...: the resumed run does not continue at the data "
                                     "position it stopped at (the epoch, the place in it, the shuffle). Hint 5."),
    Mistake("random state not saved", lambda where, got, want: got["noise"] != want["noise"],
            lambda where, got, want: f"{where} drew other random numbers than the uninterrupted run (its input noise "
                                     "differs; dropout does too): each rank's random number generators (the CPU's, "
                                     "and on a GPU the GPU's) must continue where they were. Hint 5."),
    Mistake("learning rate not restored", lambda where, got, want: got["lr"] != want["lr"],
            lambda where, got, want: f"{where} used learning rate {got['lr']:g}, the uninterrupted run {want['lr']:g}: "
                                     "the learning rate schedule did not continue where it stopped. The current rate "
                                     "lives in the optimizer's param_groups (restored with the optimizer's state, "
                                     "which also holds SGD's momentum), the schedule's position in the scheduler's own "
                                     "state_dict: both must be restored. Hint 3."),
    Mistake("weights or momentum not restored", lambda where, got, want: got["loss"] != want["loss"],
            lambda where, got, want: f"{where} saw the right samples, random numbers and learning rate but computed "
                                     "another loss: the weights it trained are not the uninterrupted run's. Both the "
                                     "model's weights and the optimizer's state (SGD's momentum) must be restored. "
                                     "Hint 3."),
)


def _compare(reference, runs, final):
    """Each step trained in the drill's runs against the same step of the uninterrupted run."""
    import torch

    for rank in sorted(reference):
        for run in runs:
            for step, got in sorted(run[rank]["trained"].items()):
                where = f"rank {rank}, step {step} (a run that resumed from step {run[rank]['start']})"
                name_the_first(STEP_MISTAKES, where, got, reference[rank]["trained"][step])
    for name, value in reference[0]["params"].items():
        if not torch.equal(final[0]["params"][name], value):
            raise CheckFailed(f"the final {name} differs from the uninterrupted run's, although every step "
                              "saw the same data, random numbers, learning rate and loss: the last steps' "
                              "updates differ (was the optimizer's momentum restored?). Hint 3.")


# The last launch failed on the half-written folder (readings: its output, its first error line).
HALF_WRITTEN_TRIED = Mistake(
    "a half-written checkpoint loaded, and failed", lambda output, error: PLANTED in output,
    lambda output, error: f"the last launch tried to load {PLANTED}, a checkpoint folder whose save never finished "
                          f"(the check left it as a SIGKILL in the middle of a save would), and failed: {error}. Load "
                          "only checkpoints known to be complete (Hint 3).")


def check_preemption_safe(script, reference, *, steps: int = 30, seed: int | None = None,
                          threads: int = 1, work=None) -> None:
    """Run the drill on ``script`` (2 ranks) and compare with ``reference``, the reports of the
    uninterrupted plain run with the same --steps and ``threads`` threads per rank."""
    script = Path(script)
    if not reference or 0 not in reference or "trained" not in reference[0]:
        raise CheckFailed("pass the .reports of the uninterrupted plain_train.py launch as `reference`.")
    if len(reference[0]["trained"]) != steps:
        raise CheckFailed(f"the reference trained {len(reference[0]['trained'])} steps, the drill runs {steps}: "
                          "launch plain_train.py with the same --steps.")
    rng = random.Random(seed)
    work = Path(work) if work else script.parent / "drill"
    shutil.rmtree(work, ignore_errors=True)
    args = ["--steps", steps]
    common = dict(nproc=2, threads=threads, work=work)
    runs = []

    # 1. SIGTERM to both ranks, as torchrun forwards it.
    job, _, last, killed = _launch(script, args, rng.randrange(3, 9), signal.SIGTERM, (0, 1), **common)
    stop1 = _after_sigterm(job, last, killed, (0, 1), "first launch")
    runs.append(job.reports)
    # 2. The same command again; SIGTERM to rank 1 only, a few steps on.
    job, _, last, killed = _launch(script, args, stop1 + rng.randrange(2, 5), signal.SIGTERM, (1,), **common)
    _started(job, "second launch")
    if job.ok and 0 in job.reports:
        _resumed(job, stop1, "second launch")
    stop2 = _after_sigterm(job, last, killed, (1,), "second launch")
    runs.append(job.reports)
    # 3. SIGKILL to both, no grace at all.
    kill_at = stop2 + rng.randrange(2, 6)
    job, _, _, _ = _launch(script, args, kill_at, signal.SIGKILL, (0, 1), **common)
    _started(job, "third launch")
    # ...and a newer folder cut short, as a SIGKILL in the middle of a save leaves one
    done = sorted(p for p in (work / "ckpt").glob("step_*") if p.is_dir())
    if done:
        planted = work / "ckpt" / PLANTED
        planted.mkdir()
        for part in done[-1].iterdir():
            if part.suffix == ".distcp":
                (planted / part.name).write_bytes(part.read_bytes()[: part.stat().st_size // 3])
    # 4. The same command, to the end.
    job, _, _, _ = _launch(script, args, None, signal.SIGTERM, (), **common)
    _started(job, "last launch")
    output = "\n".join(line for lines in job.output.values() for line in lines)
    if not job.ok or 0 not in job.reports:
        failure = job.failure
        rank, code, error = failure.rank, failure.code, failure.error
        name_the_first((HALF_WRITTEN_TRIED,), output, error)
        raise CheckFailed(f"the last launch (after a SIGKILL) failed: rank {rank}, exit code {code}: {error}.")
    _resumed(job, min(kill_at, job.reports[0]["start"]), "last launch (after a SIGKILL)")
    if job.reports[0]["start"] < stop2:
        raise CheckFailed(f"after the SIGKILL in step {kill_at}, the last launch resumed from step "
                          f"{job.reports[0]['start']}, before step {stop2}, which the second launch had saved.")
    runs.append(job.reports)
    final = job.reports
    _compare(reference, runs, final)
    passed("SIGTERM to both ranks, SIGKILL, a half-written checkpoint and SIGTERM to one rank: "
           "every relaunch resumed exactly, and the final weights equal the uninterrupted run's bit for bit")
