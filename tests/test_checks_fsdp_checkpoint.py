"""checks.check_fsdp2_checkpoint (chapter 06, exercise 2) passes the solution and names the usual
mistakes, each planted in a copy of the solution's worker: its save(step), resume() or
batches(start). The saved job runs on 2 ranks (the fewest that shard anything), the resumed job
on 1, another number of ranks as in the notebook (4, then 2), at a fraction of the cost."""

import copy
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import spike_course
from spike_course import checks
from spike_course.course import conventions
from spike_course.checks import CheckFailed, ch06_zero as zero
from spike_course.course.conventions import region_matches, written_file
from named import mistake_of, names

import course_files

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = course_files.notebook(ROOT / "solutions" / "06_fully_sharded_data_parallel.ipynb")
SOURCE = written_file(SOLUTION, "workers/06_fully_sharded_data_parallel/fsdp2_checkpoint.py")
FUNCTIONS = ("save", "resume", "batches")  # the solution regions, in the worker's order
SAVE_AT, SAVED_RANKS, RESUMED_RANKS = 3, 2, 1


def planted_worker(**bodies: str) -> str:
    """The solution's worker with the regions of the functions named in ``bodies`` (save=...,
    resume=..., batches=...) replaced by those bodies (indented 4, as in a function)."""
    regions = [match.group(0) for match in region_matches(SOURCE)]
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


MODEL_ONLY_SAVED = """\
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "scheduler": scheduler, "step": step}, checkpoint_id=args.checkpoint)
"""
SAVE_MISTAKES = {  # a mistake of the check's tables -> the planted bodies, what its message says
    "gathered whole before the save": ({"save": FULL_STATE}, r"one whole piece, none as the 2 shards"),
    "optimizer state keyed by number": ({"save": NUMBERED}, r"keyed by parameter numbers"),
    "not a DCP checkpoint": ({"save": TORCH_SAVE}, r"no \.metadata: that is not a DCP checkpoint"),
    "the scheduler not restored (left out of the save)": (
        {"save": NO_SCHEDULER_SAVED, "resume": NO_SCHEDULER_LOADED},
        r"scheduler stands at step 0, the saved job's stood at 3: the checkpoint holds no learning-rate schedule"),
    "no optimizer state": ({"save": MODEL_ONLY_SAVED, "resume": NO_SCHEDULER_LOADED.replace(
        '"optimizer": optimizer_state, ', "").replace('optim_state_dict=state["optimizer"]',
                                                      "optim_state_dict=optimizer_state")},
                           r"holds the model but no optimizer state"),
}


@pytest.mark.processes
@pytest.mark.parametrize("name", SAVE_MISTAKES)
def test_a_save_mistake_is_named(worker, tmp_path, no_orphans, name):
    bodies, message = SAVE_MISTAKES[name]
    saved, resumed = run_both(worker(planted_worker(**bodies)), tmp_path / "checkpoint")
    with names(mistake_of(name), says=message):
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


RESUME_MISTAKES = {  # a mistake of the check's tables -> the planted resume(), what its message says
    "the scheduler not restored": (NO_SCHEDULER_LOADED,
                                   r"scheduler stands at step 0, the saved job's stood at 3: the checkpoint holds it"),
    "the optimizer's hyperparameters not loaded": (
        NOT_SET, r"learning rate is 0\.025, the saved job's was 0\.0434.*param_groups"),
    "optimizer state not loaded": (MODEL_ONLY, r"momentum is all zeros"),
    "the step not read back": (STEP_NOT_READ, r"resume\(\) returned 0, the checkpoint was written after step 3"),
}


@pytest.mark.processes
@pytest.mark.parametrize("name", RESUME_MISTAKES)
def test_a_resume_mistake_is_named(solved, worker, no_orphans, name):
    body, message = RESUME_MISTAKES[name]
    saved, _, checkpoint = solved
    resumed = launch(worker(planted_worker(resume=body)), checkpoint, RESUMED_RANKS, "--resume")
    with names(name, says=re.compile(message, re.S)):
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
DATA_MISTAKES = {  # a mistake of the check's tables -> the planted batches(), what its message says
    "an epoch in another epoch's shuffle": (
        NO_SET_EPOCH, r"step 4 of the saved job \(epoch 1\) trained the very samples of step 0 \(epoch 0\)"),
    "the data restarted": (EPOCH_FROM_ITS_START, r"step 3 of the resumed job trained again the samples of step 0"),
}


@pytest.mark.processes
@pytest.mark.parametrize("name", DATA_MISTAKES)
def test_a_data_mistake_is_named(worker, tmp_path, no_orphans, name):
    body, message = DATA_MISTAKES[name]
    saved, resumed = run_both(worker(planted_worker(batches=body)), tmp_path / "checkpoint")
    with names(name, says=message):
        checks.check_fsdp2_checkpoint(saved, resumed, tmp_path / "checkpoint")


# --- the exercise as handed out, and a save that only rank 0 enters ---

@pytest.mark.processes
def test_the_blank_worker_is_named(worker, tmp_path, no_orphans):
    blank = conventions.blank_source(SOURCE)
    assert blank.count(conventions.STUB) == len(FUNCTIONS)
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
    with names("the save entered by some ranks only", says="every rank takes part in it"):
        checks.check_fsdp2_checkpoint(hung, resumed, checkpoint)


# --- what the solution's jobs reported, changed by hand (no launch) ---

def _missing_checkpoint(saved, resumed, checkpoint):
    return saved, resumed, checkpoint.parent / "elsewhere"


def _one_shard_file(saved, resumed, checkpoint, tmp_path):
    copy = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, copy)
    next(copy.glob("*.distcp")).unlink()  # as if one rank wrote nothing
    return saved, resumed, copy


def _edited(result, change):
    """``result`` with its reports deep-copied and changed by ``change(reports)``."""
    reports = copy.deepcopy(result.reports)
    change(reports)
    return replace(result, reports=reports)


def _a_parameter_more(saved, resumed, checkpoint):
    def ghost(reports):
        reports[0]["saved"]["params"]["ghost.weight"] = torch.zeros(1)
    return _edited(saved, ghost), resumed, checkpoint


def _loaded(change):
    def plant(saved, resumed, checkpoint):
        return saved, _edited(resumed, lambda reports: change(reports[0]["loaded"])), checkpoint
    return plant


def _resumed_trained(change):
    def plant(saved, resumed, checkpoint):
        return saved, _edited(resumed, lambda reports: change(reports[0]["trained"])), checkpoint
    return plant


def _nudge_all(loaded):
    for name in loaded["params"]:
        loaded["params"][name] = loaded["params"][name] + 1


def _nudge_one(loaded):
    name = next(iter(loaded["params"]))
    loaded["params"][name] = loaded["params"][name] + 1


def _another_momentum(loaded):
    name = next(iter(loaded["momentum"]))
    loaded["momentum"][name] = loaded["momentum"][name] * 2


def _another_lr(trained):
    trained[SAVE_AT]["lr"] = trained[SAVE_AT]["lr"] * 2


def _a_step_dropped(trained):
    del trained[max(trained)]


def _ids_twice(trained):
    ids = trained[SAVE_AT]["ids"]
    trained[SAVE_AT]["ids"] = torch.cat([ids[:1], ids[:-1]])  # the first sample twice, the last never


REPORTED = {  # a mistake of the check's tables -> how the solution's launches are changed, what is said
    "nothing saved": (_missing_checkpoint, "nothing was saved at"),
    "not every rank wrote": (_one_shard_file, "holds 1 shard files for 2 ranks"),
    "the model left out": (_a_parameter_more, "no entry for 1 of the model's parameters \\(e.g. 'ghost.weight'\\)"),
    "nothing loaded": (_loaded(_nudge_all), "holds none of the saved weights"),
    "some weights differ": (_loaded(_nudge_one), "1 of \\d+ weights differ from the saved ones"),
    "another momentum loaded": (_loaded(_another_momentum), "the momentum of .* is not the saved one"),
    "another learning rate": (_resumed_trained(_another_lr), f"step {SAVE_AT} of the resumed job stepped with"),
    "the wrong steps trained": (_resumed_trained(_a_step_dropped), "the resumed job trained steps"),
    "not one global batch of different samples": (_resumed_trained(_ids_twice),
                                                  f"in step {SAVE_AT} of the resumed job the ranks trained"),
}


@pytest.mark.processes
@pytest.mark.parametrize("name", REPORTED)
def test_a_mistake_reported_by_the_ranks_is_named(solved, tmp_path, name):
    plant, says = REPORTED[name]
    changed = plant(*solved, tmp_path) if plant is _one_shard_file else plant(*solved)
    with names(name, says=says):
        checks.check_fsdp2_checkpoint(*changed)


CHECK_MODULE = zero  # tests/named.py
PLANTS = {**SAVE_MISTAKES, **RESUME_MISTAKES, **DATA_MISTAKES, **REPORTED,
          "the save entered by some ranks only": "test_saving_on_rank_0_only_is_named"}
