"""checks.check_fsdp2_checkpoint (chapter 06, exercise 2) passes the solution and names the usual
mistakes, each planted in a copy of the solution's worker: its save(step), resume() or
batches(start). The saved job runs on 2 ranks (the fewest that shard anything), the resumed job
on 1, another number of ranks as in the notebook (4, then 2), at a fraction of the cost."""

import re
from dataclasses import replace
from pathlib import Path

import pytest

import spike_course
from spike_course import checks, exercises
from spike_course.checks import CheckFailed

from planting import written_file

import course_files

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = course_files.notebook(ROOT / "solutions" / "06_fully_sharded_data_parallel.ipynb")
SOURCE = written_file(SOLUTION, "06_fully_sharded_data_parallel/fsdp2_checkpoint.py")
REGION = re.compile(r"[ \t]*### BEGIN SOLUTION\n.*?### END SOLUTION\n", re.S)
FUNCTIONS = ("save", "resume", "batches")  # the solution regions, in the worker's order
SAVE_AT, SAVED_RANKS, RESUMED_RANKS = 3, 2, 1


def planted_worker(**bodies: str) -> str:
    """The solution's worker with the regions of the functions named in ``bodies`` (save=...,
    resume=..., batches=...) replaced by those bodies (indented 4, as in a function)."""
    regions = REGION.findall(SOURCE)
    assert len(regions) == len(FUNCTIONS), "the worker's solution regions changed: update this test"
    source = SOURCE
    for name, body in bodies.items():
        region = regions[FUNCTIONS.index(name)]
        assert SOURCE[:SOURCE.index(region)].rsplit("\ndef ", 1)[1].startswith(f"{name}("), \
            f"the region of {name} moved: update this test"
        source = source.replace(region, body)
    return source


def launch(path, checkpoint, nproc, *args):
    # check=False, as in the notebook: the check reads a failed launch's reports itself
    return spike_course.launch(path, nproc=nproc, args=["--checkpoint", checkpoint, *args], check=False,
                               echo=False, progress=False, timeout=120)


def run_both(path, checkpoint):
    """The notebook's two launches, smaller: save on 2 ranks (and train on), resume on 1."""
    saved = launch(path, checkpoint, SAVED_RANKS, "--save-at", SAVE_AT)
    return saved, launch(path, checkpoint, RESUMED_RANKS, "--resume")


@pytest.fixture(scope="module")
def solved(tmp_path_factory):
    """The solution's two jobs, run once: their launch results and the checkpoint folder."""
    folder = tmp_path_factory.mktemp("solved")
    (folder / "worker.py").write_text(SOURCE)
    saved, resumed = run_both(folder / "worker.py", folder / "checkpoint")
    assert saved.ok and resumed.ok, (saved.output, resumed.output)
    return saved, resumed, folder / "checkpoint"


@pytest.mark.processes
def test_the_solution_passes(solved, capsys):
    checks.check_fsdp2_checkpoint(*solved)
    assert "check passed" in capsys.readouterr().out


# --- mistakes in save(step): both jobs run the planted worker ---

FULL_STATE = """\
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    model_state, optimizer_state = get_state_dict(model, optimizer,
                                                  options=StateDictOptions(full_state_dict=True))
    dcp.save({"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler, "step": step},
             checkpoint_id=args.checkpoint)
"""
NUMBERED = """\
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler,
              "step": step}, checkpoint_id=args.checkpoint)
"""
TORCH_SAVE = """\
    if ctx.is_main:  # the habit of DDP: rank 0 saves
        import os
        os.makedirs(args.checkpoint, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": step},
                   os.path.join(args.checkpoint, "checkpoint.pt"))
"""
NO_SCHEDULER_SAVED = """\
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state, "step": step}, checkpoint_id=args.checkpoint)
"""
NO_SCHEDULER_LOADED = """\
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": -1}
    dcp.load(state, checkpoint_id=args.checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["step"]
"""


@pytest.mark.processes
@pytest.mark.parametrize("bodies, message", [
    ({"save": FULL_STATE}, r"one whole piece, none as the 2 shards"),
    ({"save": NUMBERED}, r"keyed by parameter numbers"),
    ({"save": TORCH_SAVE}, r"no \.metadata: that is not a DCP checkpoint"),
    ({"save": NO_SCHEDULER_SAVED, "resume": NO_SCHEDULER_LOADED},
     r"scheduler stands at step 0, the saved job's stood at 3: the checkpoint holds no learning-rate schedule"),
], ids=["full_state_dict-saved", "optimizer.state_dict-saved", "torch.save-on-rank-0", "scheduler-left-out"])
def test_a_save_mistake_is_named(worker, tmp_path, no_orphans, bodies, message):
    saved, resumed = run_both(worker(planted_worker(**bodies)), tmp_path / "checkpoint")
    with pytest.raises(CheckFailed, match=message):
        checks.check_fsdp2_checkpoint(saved, resumed, tmp_path / "checkpoint")


# --- mistakes in resume(): the planted worker resumes from the solution's checkpoint ---

NOT_SET = """\
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler, "step": -1}
    dcp.load(state, checkpoint_id=args.checkpoint)
    return state["step"]
"""
MODEL_ONLY = """\
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "scheduler": scheduler, "step": -1}
    dcp.load(state, checkpoint_id=args.checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optimizer_state)
    return state["step"]
"""
STEP_NOT_READ = """\
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler}
    dcp.load(state, checkpoint_id=args.checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return 0
"""


@pytest.mark.processes
@pytest.mark.parametrize("body, message", [
    (NO_SCHEDULER_LOADED, r"scheduler stands at step 0, the saved job's stood at 3: the checkpoint holds it"),
    (NOT_SET, r"learning rate is 0\.025, the saved job's was 0\.0434.*param_groups"),
    (MODEL_ONLY, r"momentum is all zeros"),
    (STEP_NOT_READ, r"resume\(\) returned 0, the checkpoint was written after step 3"),
], ids=["scheduler-not-loaded", "no-set_state_dict", "optimizer-not-loaded", "step-not-read-back"])
def test_a_resume_mistake_is_named(solved, worker, no_orphans, body, message):
    saved, _, checkpoint = solved
    resumed = launch(worker(planted_worker(resume=body)), checkpoint, RESUMED_RANKS, "--resume")
    with pytest.raises(CheckFailed, match=re.compile(message, re.S)):
        checks.check_fsdp2_checkpoint(saved, resumed, checkpoint)


# --- mistakes in batches(start): both jobs run the planted worker ---

NO_SET_EPOCH = """\
    step = start
    while step < args.steps:
        done = step % len(loader)
        for (batch_ids,) in itertools.islice(loader, done, done + args.steps - step):
            yield step, batch_ids
            step += 1
"""
EPOCH_FROM_ITS_START = """\
    step = start
    while step < args.steps:
        sampler.set_epoch(step // len(loader))
        for (batch_ids,) in itertools.islice(loader, args.steps - step):
            yield step, batch_ids
            step += 1
"""
@pytest.mark.processes
@pytest.mark.parametrize("body, message", [
    (NO_SET_EPOCH, r"step 4 of the saved job \(epoch 1\) trained the very samples of step 0 \(epoch 0\)"),
    (EPOCH_FROM_ITS_START, r"step 3 of the resumed job trained again the samples of step 0"),
], ids=["set_epoch-forgotten", "epoch-restarted"])
def test_a_data_mistake_is_named(worker, tmp_path, no_orphans, body, message):
    saved, resumed = run_both(worker(planted_worker(batches=body)), tmp_path / "checkpoint")
    with pytest.raises(CheckFailed, match=message):
        checks.check_fsdp2_checkpoint(saved, resumed, tmp_path / "checkpoint")


# --- the exercise as handed out, and a save that only rank 0 enters ---

@pytest.mark.processes
def test_the_blank_worker_is_named(worker, tmp_path, no_orphans):
    blank = exercises.blank_source(SOURCE)
    assert blank.count(exercises.STUB) == len(FUNCTIONS)
    saved, resumed = run_both(worker(blank), tmp_path / "checkpoint")
    with pytest.raises(CheckFailed, match="the worker is not written yet"):
        checks.check_fsdp2_checkpoint(saved, resumed, tmp_path / "checkpoint")


@pytest.mark.processes
def test_saving_on_rank_0_only_is_named(solved):
    """dcp.save under `if rank == 0`: rank 0 waits in the save's collective until the 60 s
    timeout (too slow to launch here), after both ranks reported what they trained."""
    saved, resumed, checkpoint = solved
    hung = replace(saved, returncodes={0: 0, 1: 1}, output={0: [], 1: [
        "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for recv"]})
    with pytest.raises(CheckFailed, match="every rank takes part in it"):
        checks.check_fsdp2_checkpoint(hung, resumed, checkpoint)
