"""Chapter 15's detectors, as the lecture writes them: each names its planted fault, and neither
raises an alarm on a healthy run, run several times (a detector that cries wolf once in a few
runs is switched off on a cluster)."""

import pytest

import spike_course
from spike_course.course import conventions

import course_files

NOTEBOOK = course_files.notebook(course_files.ROOT / "notebooks" / "15_training_through_failures.ipynb")
WRITTEN = {path.rsplit("/", 1)[1]: text for path, text in conventions.written_files(NOTEBOOK).items()}
WORLD = 3

pytestmark = pytest.mark.processes


def run(worker, name, *args, check=True):
    return spike_course.launch(worker(WRITTEN[name], name), nproc=WORLD, args=list(args), echo=False,
                               progress=False, check=check)


def test_the_straggler_detector_names_the_slow_rank_and_only_it(worker, no_orphans):
    for slow in (0, 2):  # rank 0 too: the median, not rank 0, is the yardstick
        report = run(worker, "straggler.py", "--slow-rank", slow, "--slower", 6).reports[0]
        # a set: on a busy host one window of the slow rank can dip under --ratio, and the rank is
        # named again two windows later, which is a true report too
        assert {n["rank"] for n in report["named"]} == {slow}, report["windows"]


@pytest.mark.parametrize("attempt", range(3))
def test_healthy_runs_raise_no_alarm(attempt, worker, no_orphans):
    straggler = run(worker, "straggler.py")
    assert straggler.reports[0]["named"] == [], straggler.reports[0]["windows"]
    checksums = run(worker, "checksums.py")
    assert [checksums.reports[r]["checked"] for r in range(WORLD)] == [12] * WORLD


def test_the_corruption_detector_stops_every_rank_at_the_step_of_the_flip(worker, no_orphans):
    for rank, step, bit in ((0, 5, 0), (2, 0, 30)):  # rank 0's lowest bit; a sign-adjacent exponent bit
        job = run(worker, "checksums.py", "--flip", f"{rank}:{step}:77:{bit}", check=False)
        assert not job.ok and [job.reports.get(r, {}).get("checked", 0) for r in range(WORLD)] == [step] * WORLD
