"""checks.check_sharded_blocks (chapter 16): ZeRO-3 by hand on units of several parameters,
prefetching in the forward and in the backward, against FSDP2.

The check launches the answer under a probe, and FSDP2 once per test process; so every test
here is a launch of a copy of the solution's worker on 2 ranks (about 2 s) with one mistake a
learner is likely to make planted in it. A plant cannot share a launch: the probe records what a
whole script did, step by step."""

import pytest

from spike_course.checks import ch16_large_jobs as large_jobs_check
from spike_course.checks import check_sharded_blocks
from spike_course.course import conventions
from named import names
from planting import planted

import course_files

NOTEBOOK = course_files.notebook(course_files.ROOT / "solutions" / "16_what_large_jobs_run_today.ipynb")
WORKER = conventions.written_file(NOTEBOOK, "workers/16_what_large_jobs_run_today/sharded_blocks.py")

WAIT = "        arriving.pop(k).wait()\n"
NEXT = "            arriving[k + 1] = units[k + 1].gather(async_op=True)\n"
PREFETCH = "        if k + 1 < len(units):  # the next unit's parameters travel while this unit computes\n" + NEXT
BACKWARD_NEXT = "        arriving[k - 1] = units[k - 1].gather(async_op=True)\n"
BACKWARD = ("    if k in arriving:\n" + WAIT + "    else:\n"
            "        units[k].gather()  # the first unit of the backward: nothing computed before it to hide behind\n"
            "    if k > 0:\n" + BACKWARD_NEXT)
# A mistake of the check's table -> the changes that plant it.
PLANTS = {
    "a gather never waited": [(WAIT + "        if k + 1", "        if k + 1")],
    "no gather before backward": [("        x.register_hook(lambda grad, k=k: before_backward(units, k))\n", "")],
    "parameters not freed after forward": [("        unit.free()\n", "")],
    "forward not prefetched": [("    arriving[0] = units[0].gather(async_op=True)\n", ""),
                               (WAIT + PREFETCH, "        unit.gather()\n")],
    "forward prefetch waited at once": [(NEXT, NEXT + "            arriving[k + 1].wait()\n")],
    "backward not prefetched": [(BACKWARD, "    units[k].gather()\n")],
    "backward prefetch waited at once": [(BACKWARD_NEXT, BACKWARD_NEXT + "        arriving[k - 1].wait()\n")],
}
CHECK_MODULE = large_jobs_check  # tests/named.py


@pytest.mark.processes
def test_the_solution_passes(worker, no_orphans, capsys):
    check_sharded_blocks(worker(WORKER, "sharded_blocks.py"))
    assert "check passed: 3 steps equal to FSDP2 bit for bit" in capsys.readouterr().out


@pytest.mark.processes
@pytest.mark.parametrize("mistake", sorted(PLANTS))
def test_a_planted_mistake_is_named(mistake, worker, no_orphans):
    with names(mistake):
        check_sharded_blocks(worker(planted(WORKER, *PLANTS[mistake]), "sharded_blocks.py"))


@pytest.mark.processes
def test_the_blank_exercise_is_named(worker, no_orphans):
    with names(None, says="the exercise is not written yet"):
        check_sharded_blocks(worker(conventions.blank_source(WORKER), "sharded_blocks.py"))


@pytest.mark.processes
def test_a_unit_computed_on_other_parameters_differs_from_fsdp2(worker, no_orphans):
    """Gathered and timed right, but from another rank's rows: no table names it, the digests do."""
    wrong = ("            works.append(dist.all_gather_single(full, shard, async_op=async_op))\n",
             "            works.append(dist.all_gather_single(full, shard.flip(0), async_op=async_op))\n")
    with names(None, says="after step 0 the shards differ from FSDP2's"):
        check_sharded_blocks(worker(planted(WORKER, wrong), "sharded_blocks.py"))
