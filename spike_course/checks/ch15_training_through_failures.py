"""Exercise checks for chapter 15: a job that names its stragglers and guards its own state.

Both launch the learner's script under ``failures_probe.py``, which strikes the ranks from a
plan drawn here at random, out of the script's sight. ``check_straggler_watch`` slows one node's
two ranks down from a random step (and one rank for one step only) and judges whom the script's
watch named, and when. ``check_corruption_guard`` corrupts the state of the ranks of
``guarded_train.py`` (a rank seeded differently, flipped bits high and low in weights, one in a
momentum buffer, one on rank 0, and at the last step two ranks at once); the probe records,
outside the answer's reach, a digest of every rank's weights and optimizer state right after
each step, after its fault, and after the guard. The guard must name exactly the corrupted
ranks, give them the healthy ranks' state bit for bit, leave the healthy ranks untouched, and
stop the job when no majority is left."""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from ._common import CheckFailed, Mistake, name_a_stopped_launch, name_the_first, passed

PROBE = Path(__file__).parents[1] / "lab" / "failures_probe.py"
WORLD = 3
STEPS = 10
# (step, what, the ranks it may strike, the bits it may flip): the plan's shape; ranks and bits
# are drawn per check. Two low-bit flips: a rounding fingerprint may see one by luck, hardly two.
FAULTS = ((0, "seed", (0, 1, 2), (0,)), (2, "weight", (1, 2), (20, 21, 22)), (3, "weight", (0, 1, 2), (0,)),
          (4, "weight", (0, 1, 2), (0,)), (5, "weight", (0,), (20, 21, 22)), (7, "momentum", (1, 2), (20, 21, 22)))
LOW = 0  # the lowest bit of a float32's mantissa


def draw_plan(rng: random.Random) -> list[dict]:
    """Faults at fixed steps on ranks and bits drawn from ``rng``; at the last step, two ranks."""
    plan = [{"step": step, "what": what, "rank": rng.choice(ranks), "bit": rng.choice(bits),
             "tensor": rng.choice((0, 2)), "index": rng.randrange(256)} for step, what, ranks, bits in FAULTS]
    # Two different bits: the same bit flipped on two ranks would move both integer sums alike, and
    # two corrupted ranks would outvote the healthy one (a sum is not a hash; the lecture says so).
    for rank, bit in zip(rng.sample(range(WORLD), 2), rng.sample((20, 21, 22), 2)):
        plan.append({"step": STEPS - 1, "what": "weight", "rank": rank, "bit": bit,
                     "tensor": rng.choice((0, 2)), "index": rng.randrange(256)})
    return plan


class Step:
    """What the probe recorded around one step, every rank, and what the guard said."""

    def __init__(self, number, readings, named, plan):
        self.number = number
        self.faults = [f for f in plan if f["step"] == number]
        self.stepped = {r: readings[r].get((number, "stepped")) for r in range(WORLD)}
        self.faulted = {r: readings[r][(number, "faulted")] for r in range(WORLD) if (number, "faulted") in readings[r]}
        self.guarded = {r: readings[r].get((number, "guarded")) for r in range(WORLD)}
        self.named = {r: sorted(named[r][number]) if number < len(named[r]) else None for r in range(WORLD)}
        values = list(self.stepped.values())
        self.healthy = max(values, key=values.count)  # what most ranks held after the step
        self.corrupted = sorted({r for r, v in self.stepped.items() if v != self.healthy} | set(self.faulted))
        # the states the faults left: a seeded rank's after the step, a flipped rank's after its flip
        self.bad_states = [self.stepped[r] for r in self.corrupted if r not in self.faulted] + list(self.faulted.values())
        self.verdict = self.named[0]
        self.raised_by_script = any(readings[r].get((number, "raised")) for r in range(WORLD))

    @property
    def what(self) -> str:
        return " and ".join(_described(f) for f in self.faults) or "no fault"

    def of_kind(self, what, bit=None) -> bool:
        return any(f["what"] == what and (bit is None or f["bit"] == bit) for f in self.faults)

    @property
    def missed(self) -> bool:
        return bool(self.corrupted) and self.verdict == []

    @property
    def left(self) -> list:
        """The corrupted ranks whose state after the guard is not the healthy ranks'."""
        return [r for r in self.corrupted if self.guarded[r] != self.healthy]

    @property
    def all_alike(self) -> bool:
        return len({tuple(v) for v in self.guarded.values()}) == 1

    def changed(self) -> list:
        """Healthy ranks whose state the guard changed."""
        return [r for r in range(WORLD) if r not in self.corrupted and self.guarded[r] != self.healthy]


def _described(fault) -> str:
    if fault["what"] == "seed":
        return f"rank {fault['rank']} started from weights of another seed"
    where = "weights" if fault["what"] == "weight" else "momentum buffers"
    size = "the lowest bit" if fault["bit"] == LOW else f"bit {fault['bit']}"
    return f"{size} of one number in rank {fault['rank']}'s {where} flipped"


# How the guard's verdict at a step goes wrong (readings: the step).
VERDICT_MISTAKES = (
    Mistake("verdicts differ between ranks", lambda s: len({str(v) for v in s.named.values()}) > 1,
            lambda s: f"after step {s.number} ({s.what}) the ranks' guards returned different verdicts: "
                      f"{ {r: v for r, v in s.named.items()} }. A rank that looks at its own state alone cannot know "
                      "whether it is the odd one: every rank must reach the same verdict from the same numbers (Hint 1)."),
    Mistake("rank 0 trusted", lambda s: 0 in s.corrupted and s.verdict == [r for r in range(WORLD) if r != 0],
            lambda s: f"after step {s.number} ({s.what}) the guard named ranks {s.verdict}, the healthy ones: it "
                      "took rank 0's state as the truth. Rank 0 can fail like any other; who is right must come "
                      "from the ranks that agree (Hint 1)."),
    Mistake("low bits lost in a rounding sum", lambda s: s.missed and s.of_kind("weight", LOW),
            lambda s: f"after step {s.number} {s.what}, and the guard named nobody, though it saw larger changes: "
                      "whatever the guard compares rounds that change away. It must change when any bit changes "
                      "(Hint 2)."),
    Mistake("optimizer state not compared", lambda s: s.missed and s.of_kind("momentum"),
            lambda s: f"after step {s.number} {s.what} (its weights were still right), and the guard named nobody: "
                      "at the next step that rank applies another update than the others. A rank carries more from "
                      "step to step than its weights (Hint 3)."),
    Mistake("a corrupted rank missed", lambda s: s.verdict != s.corrupted,
            lambda s: f"after step {s.number} ({s.what}) the guard named rank(s) {s.verdict}, but "
                      + (f"rank(s) {s.corrupted} held a state that differed from the others' (Hint 1, Hint 2)."
                         if s.corrupted else "every rank held the same state: what the guard compares differs "
                         "between healthy ranks, which after a step hold the same weights and buffers (Hint 1).")),
)
# How the repair after a right verdict goes wrong (readings: the step).
REPAIR_MISTAKES = (
    Mistake("repaired from the corrupted rank", lambda s: s.all_alike and s.guarded[0] in s.bad_states,
            lambda s: f"after step {s.number} ({s.what}) the guard named rank(s) {s.verdict} rightly, then every rank "
                      "ended with the corrupted state: the repair copied from a rank it had just named. Copy from a "
                      "rank of the majority (Hint 3)."),
    Mistake("repaired by averaging", lambda s: s.all_alike and s.guarded[0][0] != s.healthy[0],
            lambda s: f"after step {s.number} ({s.what}) the guard named rank(s) {s.verdict} rightly, and every rank "
                      "ended with the same weights, but not the healthy ranks' weights: the repair mixed the "
                      "corrupted numbers in (a mean of the ranks?). The corrupted state must be replaced, not "
                      "blended (Hint 3)."),
    Mistake("healthy ranks changed", lambda s: bool(s.changed()),
            lambda s: f"after step {s.number} ({s.what}) the guard changed the state of rank(s) {s.changed()}, which "
                      "were healthy: a repair touches only what the faults changed (Hint 3)."),
    Mistake("named but not repaired", lambda s: any(s.guarded[r][0] != s.healthy[0] for r in s.left),
            lambda s: f"after step {s.number} ({s.what}) the guard named rank(s) {s.verdict} rightly, but their "
                      "weights were still not the healthy ranks' when the next step began (Hint 3)."),
    Mistake("optimizer state not repaired", lambda s: bool(s.left),
            lambda s: f"after step {s.number} ({s.what}) the guard named rank(s) {s.verdict} and gave them the healthy "
                      "weights, but not the rest of the healthy state: their momentum still differed when the next "
                      "step began (Hint 3)."),
)


def check_corruption_guard(script, seed: int | None = None) -> None:
    """Run ``script`` (the exercise's guarded_train.py) on three ranks with faults drawn at random
    (``seed``: the same faults again) and judge its guard at every step."""
    plan = draw_plan(random.Random(seed))
    job, readings = _run(script, plan, WORLD, STEPS)
    if job is None:
        hung = _last_stepped(readings, plan)
        name_the_first(HANG_MISTAKES, hung)
        raise CheckFailed(f"after step {hung.number} ({hung.what}) the job hung in the guard: some ranks waited in "
                          "a collective that others never entered. Every rank must call the same collectives in the "
                          "same order.")
    if job.failure is not None and job.failure.blank:
        raise CheckFailed("guard() is not written yet: a rank stopped at `raise NotImplementedError`. "
                          "Replace that line with your code and run the check again.")
    named = {r: job.reports.get(r, {}).get("named", []) for r in range(WORLD)}
    for number in range(STEPS - 1):
        if any(number >= len(named[r]) or (number, "guarded") not in readings[r] for r in range(WORLD)):
            _stopped_early(job, _last_stepped(readings, plan))
        step = Step(number, readings, named, plan)
        name_the_first(VERDICT_MISTAKES, step)
        name_the_first(REPAIR_MISTAKES, step)
    last = Step(STEPS - 1, readings, named, plan)
    name_the_first(NO_MAJORITY_MISTAKES, job, last)
    if any((STEPS - 1, "stepped") not in readings[r] for r in range(WORLD)):
        _stopped_early(job, _last_stepped(readings, plan))  # it failed, but before the last step's faults
    passed(f"the guard named and repaired {len(FAULTS)} corruptions on the ranks they struck (a rank seeded "
           "differently, flipped bits in weights and momentum, one on rank 0) and stopped the job when no majority "
           "was left")


STALL = 5.0  # seconds without a reading once the ranks began: a step and its guard take milliseconds


class _Stalled(Exception):
    pass


class _Stall:
    """The launch's watch: ranks that recorded nothing for STALL seconds, once they began to
    step, wait in a collective that another rank never entered; stop them now, not at the
    launch's timeout."""

    def __init__(self, log: Path):
        self.log, self.size, self.since = log, 0, time.monotonic()

    def __call__(self, _result):
        size = sum(path.stat().st_size for path in self.log.glob("rank*.jsonl"))
        if size != self.size:
            self.size, self.since = size, time.monotonic()
        elif size and time.monotonic() - self.since > STALL:
            raise _Stalled()


def _run(script, plan, world, steps):
    """The launch under the probe: (its result, or None if it hung; the probe's readings)."""
    import spike_course

    log = Path(tempfile.mkdtemp(prefix="spike_course_guard_"))
    try:
        job = spike_course.launch(PROBE, nproc=world, check=False, echo=False, progress=False, timeout=60,
                                  args=[log, json.dumps(plan), Path(script).resolve(), "--steps", steps],
                                  watch=_Stall(log), watch_every=0.1)
    except _Stalled:
        job = None
    finally:
        readings = _readings(log, world)
        shutil.rmtree(log, ignore_errors=True)
    return job, readings


def _readings(log: Path, world: int) -> dict:
    """rank -> {(step, when): (weights digest, state digest)}; for "raised", whether the script's own
    code raised."""
    found = {r: {} for r in range(world)}
    for r in range(world):
        path = log / f"rank{r}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            reading = json.loads(line)
            found[r][(reading["step"], reading["when"])] = reading.get("by_script") \
                if reading["when"] == "raised" else (reading["weights"], reading["state"])
    return found


def _last_stepped(readings, plan) -> Step:
    """The last step every rank took (its guard's verdict unknown)."""
    taken = [n for n in range(STEPS) if all((n, "stepped") in readings[r] for r in range(WORLD))]
    return Step(max(taken, default=0), readings, {r: [] for r in range(WORLD)}, plan)


# A job that hung between two steps (readings: the step after which it hung).
HANG_MISTAKES = (
    Mistake("verdicts differ, and the job hung", lambda s: bool(s.corrupted),
            lambda s: f"after step {s.number} ({s.what}) the job hung in the guard: some ranks waited in a collective "
                      "that others never entered. Did every rank reach the same verdict? A rank that looks at its own "
                      "state alone cannot know whether it is the odd one (Hint 1)."),
)
# How the last step, where no majority is left, goes wrong (readings: the launch, the step).
NO_MAJORITY_MISTAKES = (
    Mistake("went on without a majority", lambda job, last: job.ok,
            lambda job, last: f"after the last step {last.what.replace(' and ', ', and ')}: no two ranks held the same "
                              f"state, and the job went on (the guard said {last.verdict}). With no majority "
                              "there is nothing to trust and nothing to copy: the job must stop with an error "
                              "(Hint 4)."),
)
# A job that failed before its last step (readings: the launch, the last step every rank took).
STOPPED_MISTAKES = (
    Mistake("stopped though a majority agreed", lambda job, s: bool(s.corrupted) and s.raised_by_script,
            lambda job, s: f"after step {s.number} ({s.what}) the job stopped with an error (rank {job.failure.rank}: "
                           f"{job.failure.error}), though the other ranks still agreed. Stopping throws away the "
                           "steps since the last checkpoint; with a majority the job can tell which rank is odd, "
                           "repair it, and go on (Hint 1, Hint 3)."),
)


def _stopped_early(job, step) -> None:
    name_the_first(STOPPED_MISTAKES, job, step)
    if job.timed_out:
        raise CheckFailed(f"the job did not finish within {job.seconds:.0f} s.")
    if job.failure is None:
        raise CheckFailed(f"a rank's guard reported no verdict for step {step.number}: the loop reports one list per "
                          "step, as it is given.")
    raise CheckFailed(f"the job stopped after step {step.number}: rank {job.failure.rank} failed (exit code "
                      f"{job.failure.code}): {job.failure.error}. Run the script with spike_course.launch to see "
                      "its traceback.")


# --- exercise 2: a watch that names the ranks that slowed down, while the job runs ---

PACE_WORLD = 4  # two pretend nodes of two ranks: a node can slow down as a whole
PACE_STEPS, EVERY, PATIENCE = 36, 4, 2  # the script's --steps and --every, and its watch's patience
# In multiples of the rank's usual compute (the probe times it before the slowdown), not in
# seconds: a host busy with other work stretches the compute several times (40 ms added was less
# than twice it there, and no watch could name the node).
SLOWER = 4  # usual computes added to each step of a slowed rank: 5x its pace, past any ratio of 3
# Its window is 10x the rank's pace; a watch whose yardstick is its first window, step 0's warm-up
# in it (two or three steps' worth), still finds it past 3x.
HICCUP = 40  # usual computes added to one step of one rank: one slow window, not a straggler
LATE = (PATIENCE + 1) * EVERY  # steps after the slowdown began by which its ranks must be named


def draw_pace_plan(rng: random.Random) -> list[dict]:
    """One node (two ranks) slowed from a step drawn after the first four windows to the end, and
    one step of one rank slowed once, earlier: a hiccup."""
    node, onset, hiccup = rng.choice(((0, 1), (2, 3))), rng.randrange(16, 23), rng.randrange(4, 12)
    plan = [{"what": "slow", "rank": rank, "step": onset, "until": PACE_STEPS, "times": SLOWER} for rank in node]
    return plan + [{"what": "slow", "rank": rng.randrange(PACE_WORLD), "step": hiccup, "until": hiccup + 1,
                    "times": HICCUP}]


class Pace:
    """What the watch named (rank 0's list of [rank, step]) against the plan."""

    def __init__(self, named: dict, plan: list):
        self.lists = named
        self.named = [tuple(n) for n in named[0]]
        slowed = [f for f in plan if f["until"] == PACE_STEPS]
        self.slowed, self.onset = sorted(f["rank"] for f in slowed), slowed[0]["step"]
        self.hiccup = next((f["rank"], f["step"]) for f in plan if f["until"] != PACE_STEPS)
        self.ranks = [rank for rank, _ in self.named]
        self.healthy_named = sorted({rank for rank, _ in self.named if rank not in self.slowed})

    @property
    def story(self) -> str:
        return (f"ranks {self.slowed} (one node) computed {SLOWER + 1} times as long as usual from step "
                f"{self.onset} on, and rank {self.hiccup[0]} {HICCUP + 1} times as long in step {self.hiccup[1]} alone")

    def late(self) -> list:
        return [rank for rank, step in self.named if rank in self.slowed and step > self.onset + LATE]


PACE_MISTAKES = (
    Mistake("the ranks name different ranks", lambda p: len({str(v) for v in p.lists.values()}) > 1,
            lambda p: f"{p.story}; the ranks' watches gave different names: "
                      f"{ {r: v for r, v in p.lists.items()} }. A rank that times itself alone knows its own pace, not "
                      "whether the others are as slow: every rank must name the same ranks (Hint 1)."),
    Mistake("one slow window is enough", lambda p: any(rank == p.hiccup[0] and step < p.onset for rank, step in p.named)
            and p.hiccup[0] not in p.slowed,
            lambda p: f"{p.story}; the watch named rank {p.hiccup[0]} at step "
                      f"{dict(p.named)[p.hiccup[0]]}: one slow window (a garbage collection, another process on the "
                      "core) is not yet a straggler (Hint 3)."),
    Mistake("a rank named again and again", lambda p: len(p.ranks) > len(set(p.ranks)),
            lambda p: f"{p.story}; the watch named the same rank more than once ({p.named}): a name is news once "
                      "(Hint 3)."),
    Mistake("a slowed node not named", lambda p: not set(p.slowed) & set(p.ranks),
            lambda p: f"{p.story}; the watch named nobody of that node. What did its clock include, and against "
                      "whose pace did it compare a rank's? A whole step lasts as long as the slowest rank's on every "
                      "rank (Hint 1); and when half the ranks slow at once, a yardstick made of all the ranks moves "
                      "with them (Hint 2)."),
    Mistake("named late", lambda p: bool(p.late()) or not set(p.slowed) <= set(p.ranks),
            lambda p: f"{p.story}; the watch named {sorted(p.named)} (as [rank, step]): each slowed rank must be named "
                      f"within {LATE} steps ({PATIENCE + 1} windows of {EVERY}) of the slowdown, while the job runs "
                      "(Hint 3)."),
)


def check_straggler_watch(script, seed: int | None = None) -> None:
    """Run ``script`` (the exercise's watched_train.py) on four ranks, one node of two slowed from
    a step drawn at random (``seed``: the same plan again) and one hiccup, and judge what its
    watch named and when."""
    plan = draw_pace_plan(random.Random(seed))
    job, _ = _run(script, plan, PACE_WORLD, PACE_STEPS)
    if job is None or job.timed_out:
        raise CheckFailed("the job hung: a rank waited in a collective that others never entered. Every rank must "
                          "call the watch's collectives at the same steps.")
    name_a_stopped_launch(job, "StragglerWatch")
    pace = Pace({r: job.reports[r].get("named", []) for r in range(PACE_WORLD)}, plan)
    name_the_first(PACE_MISTAKES, pace)
    if pace.healthy_named:  # no slip names healthy ranks reliably here (whole steps timed may): said plainly
        raise CheckFailed(f"{pace.story}; the watch also named rank(s) {pace.healthy_named}, which never slowed: "
                          "the all-reduce makes every rank's whole step as long as the slowest's (Hint 1).")
    passed(f"{pace.story}; the watch named {pace.slowed} at steps {[s for _, s in pace.named]}, and nobody else")
