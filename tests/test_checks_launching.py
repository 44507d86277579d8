"""Chapter 07's check (a resume on another number of ranks) passes the solution and names
each classic mistake.

The main mistakes are planted in a copy of the solution's worker (one solution region, or
one given line, replaced) and launched the way the exercise launches it: 2 ranks without a
stop, 2 ranks stopped after step 12 with a checkpoint, 1 rank resuming from it. The rarer
ones are planted in the solution's reported results, which is all the check reads.
"""

import copy
import shutil
from pathlib import Path

import pytest

from spike_course import launch
from spike_course.checks import CheckFailed, check_resharded_resume, ch07_launching as launching
from named import mistake_of, names
from spike_course.lab.launcher import LaunchError
from spike_course.course.conventions import written_file
from planting import replace_region

import course_files

ROOT = Path(__file__).resolve().parents[1]
WORKER = "workers/07_launching_at_scale/reshape.py"
GLOBAL_BATCH, LR, STEPS, LIMIT, STOP_AT = 64, 0.05, 20, 512, 12
ARGS = ["--global-batch", GLOBAL_BATCH, "--lr", LR, "--steps", STEPS, "--limit", LIMIT]


def solution_worker() -> str:
    notebook = course_files.notebook(ROOT / "solutions" / "07_launching_at_scale.ipynb")
    return written_file(notebook, WORKER) + "\n"


def plant(source: str, region: int, code: str) -> str:
    """The worker with solution region number ``region`` (0: per-rank batch and lr, 1: what
    the checkpoint stores, 2: where the resume continues) replaced by ``code``."""
    return replace_region(source, region, code, regions=3)


def run(script, nproc, *extra):
    return launch(script, nproc=nproc, args=ARGS + list(extra), echo=False, progress=False,
                  timeout=180).reports


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    """The solution's three runs, and the first part's checkpoint (kept for resume-only plants)."""
    folder = tmp_path_factory.mktemp("solution")
    script = folder / "reshape.py"
    script.write_text(solution_worker())
    ckpt = folder / "first_part.pt"
    runs = {"uninterrupted": run(script, 2),
            "first_part": run(script, 2, "--ckpt", ckpt, "--stop-at", STOP_AT)}
    shutil.copy(ckpt, folder / "saved_by_first_part.pt")  # the resume below leaves it as it is anyway
    runs["resumed"] = run(script, 1, "--ckpt", ckpt)
    return runs, folder / "saved_by_first_part.pt"


def check(runs):
    check_resharded_resume(runs["uninterrupted"], runs["first_part"], runs["resumed"],
                           global_batch=GLOBAL_BATCH, lr=LR)


@pytest.mark.processes
def test_the_solution_passes_and_prints_the_parameter_gap(solution, capsys):
    runs, _ = solution
    check(runs)
    out = capsys.readouterr().out
    assert "check passed" in out and "final parameters: largest difference" in out
    assert runs["resumed"][0]["resumed_from"] == STOP_AT


def launch_all(script, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    return {"uninterrupted": run(script, 2),
            "first_part": run(script, 2, "--ckpt", ckpt, "--stop-at", STOP_AT),
            "resumed": run(script, 1, "--ckpt", ckpt)}


PER_RANK_BATCH_KEPT = """\
batch_size = args.global_batch // 2   # the first job's per-rank batch, kept
lr = args.lr
"""
LR_TIMES_WORLD_SIZE = """\
batch_size = args.global_batch // ctx.world_size
lr = args.lr * ctx.world_size   # "linear scaling" with the number of GPUs
"""


@pytest.mark.processes
def test_planted_per_rank_batch_kept_is_named(solution, worker, tmp_path, no_orphans):
    """On 2 ranks this plant computes what the solution does (global batch // 2), so the
    solution's 2-rank runs and checkpoint serve; only the resume on 1 rank differs."""
    script = worker(plant(solution_worker(), 0, PER_RANK_BATCH_KEPT))
    with names("per-rank batch kept", says="per-rank batch kept when the world size changed"):
        check(resume_from_the_solutions_checkpoint(solution, script, tmp_path))


@pytest.mark.processes
def test_planted_lr_times_world_size_is_named(worker, tmp_path, no_orphans):
    script = worker(plant(solution_worker(), 0, LR_TIMES_WORLD_SIZE))
    with names("lr scaled with the world size", says="learning rate scaled with the number of ranks"):
        check(launch_all(script, tmp_path))


@pytest.mark.processes
def test_planted_position_in_one_ranks_samples_is_named(solution, worker, tmp_path, no_orphans):
    """Samples seen counted on one rank (step x per-rank batch): the resume on 1 rank reads
    half the steps. The uninterrupted run never saves, so the solution's serves."""
    script = worker(plant(solution_worker(), 1, """\
    state["samples_seen"] = step * batch_size   # the samples THIS rank has seen
    state["global_batch"] = args.global_batch
"""))
    ckpt = tmp_path / "ckpt.pt"
    runs = {"uninterrupted": solution[0]["uninterrupted"],
            "first_part": run(script, 2, "--ckpt", ckpt, "--stop-at", STOP_AT),
            "resumed": run(script, 1, "--ckpt", ckpt)}
    assert runs["resumed"][0]["resumed_from"] == STOP_AT // 2
    with names("steps trained twice", says=r"continued after step 6.*trained twice.*ONE rank"):
        check(runs)


def resume_from_the_solutions_checkpoint(solution, script, tmp_path):
    """Plants in the resume code change only the resumed run: it starts from a copy of the
    checkpoint that the solution's first part saved."""
    runs, saved = solution
    ckpt = tmp_path / "ckpt.pt"
    shutil.copy(saved, ckpt)
    return {**runs, "resumed": run(script, 1, "--ckpt", ckpt)}


@pytest.mark.processes
def test_planted_epoch_left_at_zero_is_named(solution, worker, tmp_path, no_orphans):
    script = worker(plant(solution_worker(), 2, """\
    step = state["samples_seen"] // args.global_batch
    skip = step % steps_per_epoch   # the epoch is left at 0
"""))
    with names("the wrong epoch's shuffle", says="right place in the epoch but the wrong epoch's shuffle"):
        check(resume_from_the_solutions_checkpoint(solution, script, tmp_path))


@pytest.mark.processes
def test_planted_scheduler_not_restored_is_named(solution, worker, tmp_path, no_orphans):
    source = solution_worker()
    line = '    scheduler.load_state_dict(state["scheduler"])\n'
    assert source.count(line) == 1
    script = worker(source.replace(line, ""))
    with names("scheduler not restored", says="scheduler was not restored"):
        check(resume_from_the_solutions_checkpoint(solution, script, tmp_path))


@pytest.mark.processes
def test_a_global_batch_that_does_not_divide_is_refused(worker, no_orphans):
    script = worker(solution_worker())
    with pytest.raises(LaunchError, match="does not divide into 3"):
        launch(script, nproc=3, args=ARGS, echo=False, progress=False, timeout=120)


# --- the rarer mistakes, planted in the solution's reported results ---

def edited(solution, edit):
    runs = copy.deepcopy(solution[0])
    edit(runs["uninterrupted"][0], runs["first_part"][0], runs["resumed"][0])
    return runs


def set_samples(report, step, samples):
    report["trained"][step]["samples"] = list(samples)


def scale_lr(report, factor, from_step=1):
    for s, step in report["trained"].items():
        if s >= from_step:
            step["lr"] *= factor


MISTAKES = {  # a mistake of the check's tables -> the change to the solution's reports, what is said
    "resumed on the same ranks": (lambda u, f, r: r.update(world_size=2), "as the first part did"),
    "the first part on other ranks": (lambda u, f, r: u.update(world_size=4), "launch both with the same nproc"),
    "the global batch on every rank": (lambda u, f, r: [set_samples(u, s, list(range(128))) for s in u["trained"]],
                                       r"each of the 2 ranks of the uninterrupted run took --global-batch"),
    "lr divided by the world size": (lambda u, f, r: scale_lr(u, 0.5), "learning rate divided by the number of ranks"),
    "the first part differs": (lambda u, f, r: set_samples(f, 3, u["trained"][4]["samples"]),
                               "first part's step 3 differs"),
    "started from step 0": (lambda u, f, r: r.update(resumed_from=0), "started from step 0"),
    "steps lost": (lambda u, f, r: r.update(resumed_from=14), r"steps 13..14 are never trained"),
    "model not restored": (lambda u, f, r: r["start"]["params"]["fc2.bias"].add_(1.0),
                           "did not start from the saved model"),
    "optimizer state not restored": (lambda u, f, r: r["start"].update(momentum={}), "optimizer state"),
    "steps numbered wrong": (lambda u, f, r: r["trained"].pop(20), "trained 7 steps, 13..19, expected 13..20"),
    "batches to skip off": (lambda u, f, r: set_samples(r, 13, u["trained"][14]["samples"]),
                            "the right epoch but 1 batch off"),
    "epoch and skip off": (lambda u, f, r: set_samples(r, 13, u["trained"][2]["samples"]),
                           "both the epoch and the batches to skip are off"),
    "another shuffle or split": (lambda u, f, r: set_samples(r, 13, range(64)), "no step of the uninterrupted run"),
    "lr rescaled at the resume": (lambda u, f, r: scale_lr(r, 0.5), "learning rate rescaled at the resume"),
    "the optimizer's lr not restored": (lambda u, f, r: scale_lr(r, 4.0), "restore the optimizer's state"),
    "scheduler not restored (from the second step)": (lambda u, f, r: scale_lr(r, 2.0, from_step=16),
                                                       "scheduler was not restored"),
}
CHECK_MODULE = launching  # tests/named.py
PLANTS = {**MISTAKES, "per-rank batch kept": "test_planted_per_rank_batch_kept_is_named",
          "lr scaled with the world size": "test_planted_lr_times_world_size_is_named",
          "steps trained twice": "test_planted_position_in_one_ranks_samples_is_named",
          "the wrong epoch's shuffle": "test_planted_epoch_left_at_zero_is_named",
          "a world size that does not divide the global batch not refused":
              "test_a_world_size_the_global_batch_does_not_split_over_must_be_refused"}


@pytest.mark.processes
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_reported_mistakes_are_named(solution, name):
    edit, message = MISTAKES[name]
    with names(mistake_of(name), says=message):
        check(edited(solution, edit))


@pytest.mark.processes
def test_nothing_reported_is_named(solution):
    runs = dict(solution[0], resumed={})
    with pytest.raises(CheckFailed, match="resumed run reported nothing"):
        check(runs)


@pytest.mark.processes
def test_lrs_that_agree_to_rounding_pass(solution, capsys):
    """A closed-form schedule (lr * gamma ** k) may differ from the chained one in the last bit."""
    check(edited(solution, lambda u, f, r: scale_lr(r, 1 + 2 ** -52)))
    assert "check passed" in capsys.readouterr().out


@pytest.mark.processes
def test_a_world_size_the_global_batch_does_not_split_over_must_be_refused(solution, tmp_path, capsys):
    runs, _ = solution
    script = tmp_path / "reshape.py"
    script.write_text(solution_worker())
    refused = launch(script, nproc=3, args=ARGS, echo=False, progress=False, check=False, timeout=180)
    assert not refused.ok
    check_resharded_resume(runs["uninterrupted"], runs["first_part"], runs["resumed"],
                           global_batch=GLOBAL_BATCH, lr=LR, uneven=refused)
    assert "check passed" in capsys.readouterr().out

    # The region without its refusal: 3 ranks x 21 samples train silently, 63 per step.
    source = solution_worker()
    start = source.index("if args.global_batch % ctx.world_size:")
    end = source.index("batch_size = args.global_batch // ctx.world_size")
    script.write_text(source[:start] + source[end:])
    silent = launch(script, nproc=3, args=ARGS, echo=False, progress=False, check=False, timeout=180)
    assert silent.ok
    with names("a world size that does not divide the global batch not refused",
               says=r"does not split into 3 equal per-rank batches \(each rank took 21, so a step was 63 samples\)"):
        check_resharded_resume(runs["uninterrupted"], runs["first_part"], runs["resumed"],
                               global_batch=GLOBAL_BATCH, lr=LR, uneven=silent)
