"""checks.check_straggler_watch and checks.check_corruption_guard (chapter 15): a watch that
names the ranks that slowed down, and a guard that names and repairs corrupted ranks.

Each check launches the answer itself, under a probe that strikes the ranks from a plan drawn
at random; so every test here is a launch of a copy of a solution's worker (4 or 3 ranks, about
2 s each), with one mistake a learner is likely to make planted in it. The plan is drawn from a
fixed seed in the plants, so that each names its mistake at the same step on every run; the
solutions pass three other seeds."""

import re

import pytest

from spike_course.checks import check_corruption_guard, check_straggler_watch
from spike_course.checks import ch15_training_through_failures as failures_check
from spike_course.course import conventions
from named import names
from planting import planted, replace_region

import course_files

NOTEBOOK = course_files.notebook(course_files.ROOT / "solutions" / "15_training_through_failures.ipynb")
WORKER = conventions.written_file(NOTEBOOK, "workers/15_training_through_failures/guarded_train.py")
WATCH = conventions.written_file(NOTEBOOK, "workers/15_training_through_failures/watched_train.py")
SEED = 1
PACE_SEED = 2  # ranks 0 and 1 slowed from step 16: a watch four windows patient names them at step 31, late

# The lecture's detector (15.2) as the answer: it stops the job at the first difference.
LECTURE = '''    total = sum(p.detach().view(torch.int32).to(torch.int64).sum() for p in model.parameters())
    lowest, highest = total.clone(), total.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    if lowest != highest:
        raise RuntimeError("the ranks' weights differ: stopping")
    return []
'''
FINGERPRINT = "    mine = sum(t.reshape(-1).view(torch.int32).to(torch.int64).sum() for t in tensors).reshape(1)"
VERDICT = "    odd = [rank for rank, value in enumerate(sums) if value != majority]"
REPAIR = "            dist.broadcast(t, src=healthy)"
# A mistake of the guard's tables -> the changes that plant it, and what its message must say.
GUARD_PLANTS = {
    "low bits lost in a rounding sum": ([(FINGERPRINT, "    mine = sum(t.sum() for t in tensors).reshape(1)"),
                                         ("dtype=torch.int64, device", "dtype=torch.float32, device")],
                                        r"after step 3 the lowest bit .* named nobody"),
    "optimizer state not compared": ([("    tensors += [value for p", "    buffers = [value for p"),
                                      (REPAIR, REPAIR + "\n        for t in buffers:\n" + REPAIR)],
                                     r"after step 7 .* momentum buffers flipped .* named nobody"),
    "rank 0 trusted": ([(VERDICT, "    odd = [rank for rank, value in enumerate(sums) if value != sums[0]]"),
                        ("        healthy = sums.index(majority)", "        healthy = 0")],
                       r"after step \d .* named ranks \[1, 2\], the healthy ones"),
    "verdicts differ between ranks": ([("    return odd\n", "    return [ctx.rank] if ctx.rank in odd else []\n")],
                                      r"returned different verdicts"),
    "verdicts differ, and the job hung": ([(VERDICT, "    odd = [ctx.rank] if sums[ctx.rank] != majority else []")],
                                          r"after step 0 .* hung in the guard"),
    "a corrupted rank missed": ([("    return odd\n", "    return []\n"), (REPAIR, "            pass")],
                                r"after step 0 \(rank \d started from weights of another seed\) the guard named rank\(s\) \[\]"),
    "named but not repaired": ([(REPAIR, "            pass")], r"weights were still not the healthy ranks'"),
    "optimizer state not repaired": ([("        for t in tensors:\n" + REPAIR,
                                       "        for p in model.parameters():\n            dist.broadcast(p.data, src=healthy)")],
                                     r"after step 7 .* momentum still differed"),
    "repaired by averaging": ([(REPAIR, "            dist.all_reduce(t, op=dist.ReduceOp.AVG)")], r"not blended"),
    "repaired from the corrupted rank": ([(REPAIR, "            dist.broadcast(t, src=odd[0])")],
                                         r"copied from a rank it had just named"),
    "healthy ranks changed": ([(REPAIR, REPAIR + "\n        for p in model.parameters():\n"
                                        "            optimizer.state[p]['momentum_buffer'].zero_()")],
                              r"changed the state of rank\(s\) \[\d, \d\], which were healthy"),
    "went on without a majority": ([("    if votes <= ctx.world_size // 2:", "    if False:")],
                                   r"after the last step .* no two ranks held the same state"),
    "stopped though a majority agreed": (LECTURE, r"after step 0 .* stopped with an error"),
}
READY = "    def ready(self) -> None:\n        self.compute.append(self.clock() - self.started)\n"
NAME_ONCE = "            if self.streak[rank] >= self.patience and rank not in self.named:"
GATHER = "        dist.all_gather_into_tensor(every, mine)\n"
# A mistake of the watch's table -> the changes that plant it, and what its message must say.
PACE_PLANTS = {
    "one slow window is enough": ([(NAME_ONCE, "            if self.streak[rank] >= 1 and rank not in self.named:")],
                                  r"named rank 2 at step 7: one slow window"),
    "a rank named again and again": ([(NAME_ONCE, "            if self.streak[rank] >= self.patience:")],
                                     r"named the same rank more than once"),
    "a slowed node not named": ([("            usual = statistics.median(self.paces[rank]) if self.paces[rank] else pace",
                                  "            usual = statistics.median(every.tolist())")],
                                r"ranks \[0, 1\] \(one node\) .* named nobody of that node"),
    "named late": ([(NAME_ONCE, "            if self.streak[rank] >= self.patience + 2 and rank not in self.named:")],
                   r"within 12 steps"),
    "the ranks name different ranks": ([(GATHER, "        every[self.ctx.rank] = mine\n")],
                                       r"gave different names: \{0: \[\[0, \d+\]\], 1: \[\[1, \d+\]\], 2: \[\], 3: \[\]\}"),
}
PLANTS = {**GUARD_PLANTS, **PACE_PLANTS}
# Whole steps timed: the all-reduce stretches every rank's step as the slowed node's. Whether that
# passes the watch's ratio depends on how much of a step the compute is on this host: the watch
# names nobody, or all four ranks.
WHOLE_STEPS = [(READY, "    def ready(self) -> None:\n        pass\n"),
               ("        if len(self.compute) < self.every:",
                "        self.compute.append(self.clock() - self.started)\n        if len(self.compute) < self.every:")]
CHECK_MODULE = failures_check  # tests/named.py


def plant(source, changes) -> str:
    if isinstance(changes, str):  # the whole answer replaced
        return replace_region(source, 0, changes, regions=1)
    return planted(source, *changes)


@pytest.mark.processes
@pytest.mark.parametrize("seed", [0, 2, 3])
def test_the_solution_passes_whatever_the_plan(seed, worker, no_orphans, capsys):
    check_corruption_guard(worker(WORKER, "guarded_train.py"), seed=seed)
    assert "check passed: the guard named and repaired 6 corruptions" in capsys.readouterr().out


@pytest.mark.processes
@pytest.mark.parametrize("mistake", sorted(GUARD_PLANTS))
def test_a_planted_mistake_of_the_guard_is_named(mistake, worker, no_orphans):
    changes, message = GUARD_PLANTS[mistake]
    with names(mistake, says=re.compile(message, re.S)):
        check_corruption_guard(worker(plant(WORKER, changes), "guarded_train.py"), seed=SEED)


@pytest.mark.processes
@pytest.mark.parametrize("seed", [0, 1, 3])
def test_the_watch_passes_whatever_the_plan(seed, worker, no_orphans, capsys):
    check_straggler_watch(worker(WATCH, "watched_train.py"), seed=seed)
    assert "and nobody else" in capsys.readouterr().out


@pytest.mark.processes
@pytest.mark.parametrize("mistake", sorted(PACE_PLANTS))
def test_a_planted_mistake_of_the_watch_is_named(mistake, worker, no_orphans):
    changes, message = PACE_PLANTS[mistake]
    with names(mistake, says=re.compile(message, re.S)):
        check_straggler_watch(worker(plant(WATCH, changes), "watched_train.py"), seed=PACE_SEED)


@pytest.mark.processes
def test_whole_steps_timed_are_named(worker, no_orphans):
    with names(("a slowed node not named", None), says=r"What did its clock include|which never slowed: the all-reduce"):
        check_straggler_watch(worker(plant(WATCH, WHOLE_STEPS), "watched_train.py"), seed=PACE_SEED)


@pytest.mark.processes
def test_the_blank_watch_is_named(worker, no_orphans):
    with names(None, says="StragglerWatch is not written yet"):
        check_straggler_watch(worker(conventions.blank_source(WATCH), "watched_train.py"), seed=PACE_SEED)


@pytest.mark.processes
def test_the_blank_exercise_is_named(worker, no_orphans):
    with names(None, says="guard\\(\\) is not written yet"):
        check_corruption_guard(worker(conventions.blank_source(WORKER), "guarded_train.py"), seed=SEED)


def test_every_plan_strikes_each_rank_kind_and_ends_with_two_ranks():
    """The plan's shape holds whatever its draw: rank 0 struck once at least, a low bit twice,
    the momentum once, and two different ranks at the last step."""
    import random

    for seed in range(50):
        plan = failures_check.draw_plan(random.Random(seed))
        assert any(f["rank"] == 0 and f["what"] == "weight" for f in plan)
        assert sum(f["bit"] == failures_check.LOW and f["what"] == "weight" for f in plan) == 2
        last = [f for f in plan if f["step"] == failures_check.STEPS - 1]
        assert len({f["rank"] for f in last}) == 2 and len({f["bit"] for f in last}) == 2
