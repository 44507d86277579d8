"""The capstone's check passes on the solution and names each mistake planted in a copy of it.

Each test takes the solution's train.py (the %%writefile cell of the solution notebook,
without its solution markers), plants one classic mistake with a string replacement and
asserts the check's message. A launch is a few seconds: the mistakes that show in the first
run stop the check there; only set_epoch and resume need the second, crashing run.
"""

from pathlib import Path

import nbformat
import pytest

from spike_course import workers
from spike_course.checks import CheckFailed, check_capstone_job, check_capstone_submit
from spike_course.runai import submit_command, torchrun_command

ROOT = Path(__file__).resolve().parents[1]
STEM = "15_capstone_your_own_job"
SOLUTION_NOTEBOOK = nbformat.read(ROOT / "solutions" / f"{STEM}.ipynb", as_version=4)
SOLUTION = workers.worker_cells(SOLUTION_NOTEBOOK)[f"{STEM}/train.py"]


def plant(tmp_path, old, new):
    assert old in SOLUTION, f"the solution no longer contains {old!r}: update this test"
    script = tmp_path / "train.py"
    script.write_text(SOLUTION.replace(old, new, 1))
    return script


def test_the_solution_imports_nothing_from_the_course():
    # That the check passes the solution is shown by the solution notebook's own check cell
    # (nbval runs it): the same check on the same script, one torchrun pair of runs.
    assert "spike_course" not in SOLUTION


def test_places_left_blank_are_named_before_any_rank_starts(tmp_path):
    blank = 'raise NotImplementedError("exercise: replace this line with your code")'
    script = plant(tmp_path, "train_sampler.set_epoch(epoch)  #", f"{blank}  #")
    line = script.read_text().splitlines().index(f"    {blank}  # a new shuffle every epoch, the same one on every rank") + 1
    with pytest.raises(CheckFailed, match=rf"lines \[{line}\] of your script still raise NotImplementedError"):
        check_capstone_job(script, tmp_path)
    assert not (tmp_path / "capstone_check" / "calls").exists()  # no torchrun was started


MISTAKES = {
    "set_epoch forgotten": ("    train_sampler.set_epoch(epoch)", "    pass", "same shuffle as epoch 1"),
    "no sampler": ("sampler=train_sampler)", "shuffle=True)", "has no DistributedSampler"),
    "sampler and shuffle=True": ("sampler=train_sampler)", "sampler=train_sampler, shuffle=True)",
                                 "remove shuffle=True"),
    "device_ids not a list": ("device_ids=[local_rank] if", "device_ids=local_rank if", "is not a list"),
    "every rank saves": ("    if rank == 0:\n        state = {", "    if True:\n        state = {",
                         "all called torch.save"),
    "module. keys": ('"model": model.state_dict()', '"model": ddp_model.state_dict()', "start with 'module.'"),
    "unaveraged metric": ("    dist.all_reduce(counts, op=dist.ReduceOp.SUM)\n", "", "rank 0's own shard"),
    "padded test shards": ("Subset(test_set, range(rank, len(test_set), world_size)),",
                           "test_set, sampler=DistributedSampler(test_set, shuffle=False),", "counts 202 samples"),
    "non-atomic save": ('tmp = checkpoint.with_name(checkpoint.name + ".tmp")', "tmp = checkpoint",
                        "wrote straight to the checkpoint"),
    "no destroy_process_group": ("\ndist.destroy_process_group()", "\npass", "destroy_process_group() was not called"),
    "no resume": ("if checkpoint.exists():", "if False:", "epochs evaluated"),
    "imports spike_course": ("import torch\n", "import torch\nimport spike_course\n", "imports spike_course"),
}


@pytest.mark.processes
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_each_mistake_is_named(tmp_path, name, no_orphans):
    old, new, message = MISTAKES[name]
    with pytest.raises(CheckFailed, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_capstone_job(plant(tmp_path, old, new), tmp_path)


@pytest.mark.processes
def test_a_hanging_rank_is_stopped_with_a_clear_message(tmp_path, monkeypatch, no_orphans):
    from spike_course.checks import capstone

    # Rank 1 never reaches DDP's first broadcast (as if stuck elsewhere); rank 0 waits in it.
    # The ranks get there about 6 s after torchrun starts here; 15 s leaves room on a slower machine.
    monkeypatch.setattr(capstone, "LAUNCH_TIMEOUT", 15)
    script = plant(tmp_path, "ddp_model = DDP(",
                   "if rank == 1:\n    __import__('time').sleep(600)\nddp_model = DDP(")
    with pytest.raises(CheckFailed, match="more than 15 s"):
        check_capstone_job(script, tmp_path)


IMAGE = "harbor.spike.tue.nl/aiteam/pretrainingcontainer:latest"


def line(**changes):
    settings = dict(command="cd /data/course; " + torchrun_command("train.py", "--checkpoint",
                                                                   "/data/ckpt/c.pt", nproc_per_node=8),
                    gpus=8, workers=1, pvc="aiteam", cpu=7, memory="64G")  # + the master pod
    settings.update(changes)
    return submit_command("mnist-capstone", IMAGE, "aiteam", **settings)


@pytest.mark.parametrize("pods", [dict(), dict(workers=2, extra=["--no-master"])])
def test_the_right_runai_line_passes(capsys, pods):
    check_capstone_submit(line(**pods))
    assert "check passed" in capsys.readouterr().out


@pytest.mark.parametrize("changes, message", [
    (dict(workers=None), "not a distributed PyTorch workload"),
    (dict(workers=2), "asks for 3 pods (2 workers and the master pod Run:ai adds)"),
    (dict(workers=16), "asks for 17 pods"),
    (dict(workers=1, extra=["--no-master"]), "asks for 1 pods (1 workers, no master)"),
    (dict(gpus=1), "--gpu-devices-request is 1"),
    (dict(command="cd /data/course; python3 train.py"), "does not start torchrun"),
    (dict(command="cd /data/course; torchrun --standalone --nproc-per-node=8 train.py"), "--standalone"),
    (dict(command="cd /data/course; torchrun --nnodes=2 --nproc-per-node=8 train.py"), "PET_"),
    (dict(command="cd /data/course; torchrun --nproc-per-node=1 train.py"), "one process per GPU"),
    (dict(command="cd /data/course; torchrun --nproc-per-node=8 other.py"), "does not run train.py"),
    (dict(pvc=None), "mount the team's volume"),
])
def test_runai_mistakes_are_named(changes, message):
    with pytest.raises(CheckFailed, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_capstone_submit(line(**changes))
