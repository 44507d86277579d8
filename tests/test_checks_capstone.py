"""The capstone's check passes on the solution and on other correct conversions, and names
each mistake planted in a copy of the solution.

Each test takes the solution's train.py (the %%writefile cell of the solution notebook,
without its solution markers), plants mistakes with string replacements and asserts the
check's messages. The check runs the job as 2 nodes with a crash and a restart (about 15 s
here), then a pretend GPU start (2 nodes of 2 processes and 1 GPU, about 5 s, no torchrun agents). A launch is
what costs, so the mistakes that different steps of the check see, and that leave the rest
of the job alone, are planted together (GROUPS): one launch, and the check, collecting,
must name each of them and nothing else. The others are planted alone, and the check must
name them first, as a learner sees it.
"""

import re
from pathlib import Path

import pytest

from spike_course.course import conventions, exercises, workers
from spike_course.checks import CheckFailed, ch17_capstone as capstone, check_capstone_job, check_capstone_submit
from spike_course.runai import submit_command, torchrun_command

from named import mistake_of, names

import course_files

ROOT = Path(__file__).resolve().parents[1]
STEM = "17_capstone_your_own_job"
SOLUTION_NOTEBOOK = course_files.notebook(ROOT / "solutions" / f"{STEM}.ipynb")
SOLUTION = workers.worker_cells(SOLUTION_NOTEBOOK)[f"{STEM}/train.py"]
SINGLE = workers.worker_cells(SOLUTION_NOTEBOOK)[f"{STEM}/single.py"]


def plant(tmp_path, *changes):
    source = SOLUTION
    for old, new in changes:
        assert old in source, f"the solution no longer contains {old!r}: update this test"
        source = source.replace(old, new, 1)
    script = tmp_path / "train.py"
    script.write_text(source)
    return script


def test_the_solution_imports_nothing_from_the_course_and_keeps_the_model():
    # That the check passes the solution is shown by the solution notebook's own check cell
    # (nbval runs it) and by the correct variants below.
    assert "spike_course" not in SOLUTION
    assert f"class {capstone.two_node_job.MODEL_CLASS}(nn.Module)" in SINGLE
    assert SINGLE[SINGLE.index("class "):SINGLE.index("def datasets")] in SOLUTION  # the replay's model


def test_the_exercise_starts_as_the_one_gpu_script_and_is_named_before_any_rank_starts(tmp_path):
    blank = exercises.make_exercise(SOLUTION_NOTEBOOK)
    script = tmp_path / "train.py"
    script.write_text(conventions.written_file(blank, f"workers/{STEM}/train.py"))
    assert SINGLE.strip() in script.read_text()
    with pytest.raises(CheckFailed, match="line 2 still raises NotImplementedError"):
        check_capstone_job(script, tmp_path)
    assert not (tmp_path / "capstone_check" / "calls").exists()  # no torchrun was started


@pytest.mark.processes
def test_the_unconverted_script_is_named(tmp_path, no_orphans):
    script = tmp_path / "train.py"
    script.write_text(SINGLE)
    with names("never joined a process group", says=r"never called init_process_group(.|\n)*What your ranks did"):
        check_capstone_job(script, tmp_path)


def test_an_import_of_the_course_is_named_before_any_rank_starts(tmp_path):
    with pytest.raises(CheckFailed, match="imports spike_course"):
        check_capstone_job(plant(tmp_path, ("import torch\n", "import torch\nimport spike_course\n")), tmp_path)


# (name: changes to the solution, the message's words). The mistakes that the first attempt shows
# (hints 1-4): the check names them when the planned crash ends it. tests/test_checks_capstone_first_attempt.py
# plants these, so that the two halves run on both of CI's workers.
FIRST_ATTEMPT_MISTAKES = {
    "no sampler": ([("sampler=sampler, drop_last=True", "shuffle=True, drop_last=True")],
                   "trained on the same samples"),
    "sampler and shuffle": ([("sampler=sampler, drop_last=True", "sampler=sampler, shuffle=True")],
                            "refused sampler= together with shuffle=True"),
    "set_epoch forgotten": ([("        sampler.set_epoch(epoch)\n", "")], "same order as epoch 0"),
    "global batch grows": ([("accumulation = args.batch_size // per_step",
                             "accumulation = args.batch_size // args.micro_batch")],
                           "grew with the number of ranks"),
    "micro-batch grows": ([("batch_size=args.micro_batch, sampler", "batch_size=2 * args.micro_batch, sampler"),
                           ("accumulation = args.batch_size // per_step", "accumulation = 1")],
                          "took 16 samples, more than --micro-batch"),
    "no no_sync": ([("contextlib.nullcontext() if last else ddp_model.no_sync()", "contextlib.nullcontext()")],
                   "2 times per optimizer step"),
    "the plain model trained": ([("F.cross_entropy(ddp_model(images), labels)", "F.cross_entropy(model(images), labels)")],
                                "no gradient was all-reduced"),
    "ranks start apart": ([("    torch.manual_seed(args.seed)\n", "    torch.manual_seed(args.seed + rank)\n"),
                           ("if device.type == \"cuda\" else None)", "if device.type == \"cuda\" else None, init_sync=False)")],
                          "other initial weights"),
    "train mode dropped": ([("        ddp_model.train()\n", "")], "never put back in train mode"),
    "schedule's horizon": ([("steps_per_epoch = len(train_loader) // accumulation",
                             "steps_per_epoch = len(train_loader) // (args.batch_size // args.micro_batch)")],
                           "cosine decays over 8 optimizer steps"),
    # One process per node: every rank is LOCAL_RANK 0, so both read alike (the message names both).
    "more than one writer (every rank)": ([("if rank == 0:  # one log and one writer", "if True:  # one log and one writer")],
                          "rank 1, LOCAL_RANK 0 of the second node, wrote checkpoint.pt.partial too"),
    "more than one writer (LOCAL_RANK 0 on each node)": ([("if rank == 0:  # one log and one writer",
                              "if int(os.environ['LOCAL_RANK']) == 0:  # one log and one writer")],
                            "rank 1, LOCAL_RANK 0 of the second node, wrote checkpoint.pt.partial too"),
    "every rank prints": ([("step % args.log_every == 0 and rank == 0", "step % args.log_every == 0")],
                          r"rank\(s\) \[1\] printed"),
    "every rank logs metrics": ([("""            with open(args.metrics, "a") as log:
                log.write(json.dumps({"epoch": epoch, "step": step, "test_loss": test_loss,
                                      "test_accuracy": accuracy}) + "\\n")
""", """        with open(args.metrics, "a") as log:
            log.write(json.dumps({"epoch": epoch, "step": step, "test_loss": test_loss,
                                  "test_accuracy": accuracy}) + "\\n")
        if rank == 0:
""")], "also appended to the metrics log"),
    "module. keys": ([('"model": model.state_dict()', '"model": ddp_model.state_dict()')], "start with 'module.'"),
    "written in place": ([('partial = checkpoint.with_name(checkpoint.name + ".partial")', "partial = checkpoint")],
                         "wrote straight to the checkpoint's path"),
    "copied, not renamed": ([("os.replace(partial, checkpoint)", "__import__('shutil').copyfile(partial, checkpoint)")],
                            "without a rename"),
    "no barrier": ([("        dist.barrier()  # nobody goes on", "        pass  # nobody goes on")],
                   "while rank 0 was still writing"),
    "whole test set everywhere": ([("DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=256",
                                    "DataLoader(test_set, batch_size=256")],
                                  "every rank evaluated the whole test set"),
    "padded test shards": ([("DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=256",
                             "DataLoader(test_set, sampler=DistributedSampler(test_set, shuffle=False), batch_size=256")],
                           "evaluated on more than one rank"),
}

# The mistakes that only the restart and the end of the job show (hint 5 and the replay).
MISTAKES = {
    "metric not all-reduced": ([("    dist.all_reduce(totals)\n", "")], "rank 0's own part only"),
    "no resume": ([("if checkpoint.exists():", "if False:")], "did not load checkpoint.pt"),
    "no map_location": ([("torch.load(checkpoint, map_location=device)", "torch.load(checkpoint)")],
                        "without map_location"),
    "optimizer not restored": ([('        optimizer.load_state_dict(state["optimizer"])\n', "")],
                               "optimizer started without its state"),
    "scheduler not restored": ([('        scheduler.load_state_dict(state["scheduler"])\n', "")],
                               "the schedule started over"),
    "another order after the restart": ([("sampler.set_epoch(epoch)", "sampler.set_epoch(epoch + start_epoch)")],
                                        "another order than before the crash"),
    "no destroy_process_group": ([("    dist.destroy_process_group()\n", "")], "never called destroy_process_group"),
    "metrics lost at the restart": ([('with open(args.metrics, "a") as log:', 'with open(args.metrics, "w") as log:')],
                                    r"holds epochs \[\d\] of 2"),
}

# Mistakes that only a GPU node shows: the check's pretend-GPU start names them.
GPU_MISTAKES = {
    # rank 2 is LOCAL_RANK 0 of the second node
    "a GPU from RANK (set_device)": ([('device = torch.device("cuda", local_rank % gpus)', 'device = torch.device("cuda", rank)')],
                      "rank 2 is LOCAL_RANK 0 on its node, but torch.cuda.set_device got GPU 2"),
    "a GPU from RANK (DDP's device_ids)": ([("device_ids=[device.index] if", "device_ids=[rank] if")],
                             "rank 2 is LOCAL_RANK 0 on its node, but DDP's device_ids got GPU 2"),
    "a GPU the node does not have": (
        [('device = torch.device("cuda", local_rank % gpus)', 'device = torch.device("cuda", local_rank)')],
        r"rank 1 \(LOCAL_RANK 1\) runs on a node with 1 GPU for 2 processes.*torch.cuda.set_device asked for "
        r"GPU 1, which that node does not have"),
    "gloo on GPUs": ([('dist.init_process_group("nccl", device_id=device)', 'dist.init_process_group("gloo")')],
                     "still starts the gloo backend"),
    "no set_device": ([("        torch.cuda.set_device(device)  #", "        pass  #")], "never called torch.cuda.set_device"),
    "device_ids not a list": ([("device_ids=[device.index] if", "device_ids=device.index if")], "is not a list"),
}


# Mistakes that different steps of the check see and that change nothing else the check
# looks at: planted together, one launch each. The GPU mistakes are only in the script's
# CUDA branch, so they ride along with the others. The rest change what later steps see
# (the arithmetic, the schedule, the metrics log, the epochs) or make the job fail: alone.
GROUPS = [
    ["train mode dropped", "every rank prints", "written in place", "no barrier", "whole test set everywhere",
     "gloo on GPUs", "a GPU from RANK (DDP's device_ids)"],
    ["set_epoch forgotten", "copied, not renamed", "no set_device",
     "no destroy_process_group", "metrics lost at the restart"],
    ["metric not all-reduced", "no map_location", "device_ids not a list", "a GPU the node does not have"],
    ["another order after the restart", "scheduler not restored", "a GPU from RANK (set_device)"],
]
# First-attempt mistakes the check names before the restart, planted together: the job is
# stopped once its first attempt is judged, as a learner's is.
FIRST_ATTEMPT_GROUPS = [
    ["ranks start apart", "no no_sync", "every rank logs metrics", "module. keys", "schedule's horizon"],
    ["micro-batch grows", "the plain model trained", "padded test shards"],
]
# Correct answers that choose differently from the solution: the replay follows them, so the
# check names nothing for them. They ride along with the second group (a launch is what
# costs): a message for either would name none of that group's mistakes, and fail its test.
VARIANTS = {
    "its own sampler seed": [("seed=args.seed,", "seed=args.seed + 1234,")],
    "epochs numbered from 1": [("    start_epoch = 0\n", "    start_epoch = 1\n"),
                               ("    step = start_epoch * steps_per_epoch", "    step = (start_epoch - 1) * steps_per_epoch"),
                               ("for epoch in range(start_epoch, args.epochs):",
                                "for epoch in range(start_epoch, args.epochs + 1):")],
}
WITH_VARIANTS = 1  # the index in GROUPS
ALL_MISTAKES = {**FIRST_ATTEMPT_MISTAKES, **MISTAKES, **GPU_MISTAKES}
ALONE = sorted(set(ALL_MISTAKES) - {name for group in GROUPS + FIRST_ATTEMPT_GROUPS for name in group})


def test_every_mistake_is_planted_once():
    planted = [name for group in GROUPS + FIRST_ATTEMPT_GROUPS for name in group] + ALONE
    assert sorted(planted) == sorted(ALL_MISTAKES)
    assert not set(ALONE) & set(GPU_MISTAKES), "a GPU mistake can ride along in a group"
    assert all(name in FIRST_ATTEMPT_MISTAKES for group in FIRST_ATTEMPT_GROUPS for name in group)


CHECK_MODULE = capstone  # tests/named.py: the check's tables, each mistake planted here (PLANTS, at the end)


def planted_alone_is_named(tmp_path, name):
    changes, message = ALL_MISTAKES[name]
    with names(mistake_of(name), says=message):
        check_capstone_job(plant(tmp_path, *changes), tmp_path)


def planted_together_are_each_named(tmp_path, group, first_attempt_only=False, correct=()):
    """One launch of a script with every mistake of ``group`` (and the ``correct`` changes): the
    check, collecting, names each of them once, with its words, and nothing else."""
    script = plant(tmp_path, *[change for name in group for change in ALL_MISTAKES[name][0]], *correct)
    failures = capstone.capstone_job_mistakes(script, tmp_path, first_attempt_only)
    said = "\n\n".join(f"[{failure.mistake}] {failure}" for failure in failures)
    assert sorted(failure.mistake or "" for failure in failures) == sorted(mistake_of(name) for name in group), said
    for name in group:
        message = next(str(failure) for failure in failures if failure.mistake == mistake_of(name))
        assert re.search(ALL_MISTAKES[name][1], message), said


@pytest.mark.processes
@pytest.mark.parametrize("name", [name for name in ALONE if name not in FIRST_ATTEMPT_MISTAKES])
def test_each_mistake_of_the_restart_and_the_end_is_named(tmp_path, name, no_orphans):
    planted_alone_is_named(tmp_path, name)


@pytest.mark.processes
@pytest.mark.parametrize("group", GROUPS, ids=[group[0] for group in GROUPS])
def test_mistakes_planted_together_are_each_named_and_nothing_else(tmp_path, group, no_orphans):
    correct = sum(VARIANTS.values(), []) if group is GROUPS[WITH_VARIANTS] else []
    planted_together_are_each_named(tmp_path, group, correct=correct)


@pytest.mark.processes
def test_a_hanging_rank_is_stopped_with_a_clear_message(tmp_path, monkeypatch, no_orphans):
    # Rank 1 never reaches DDP's first broadcast (as if stuck elsewhere); rank 0 waits in it.
    monkeypatch.setattr(capstone.two_node_job, "LAUNCH_TIMEOUT", 12)
    script = plant(tmp_path, ("    ddp_model = DDP(", "    if rank == 1:\n        __import__('time').sleep(600)\n    ddp_model = DDP("))
    with names("a rank waits for ever", says="more than 12 s"):
        check_capstone_job(script, tmp_path)


IMAGE = "harbor.spike.tue.nl/aiteam/pretrainingcontainer:latest"


def line(image=IMAGE, **changes):
    settings = dict(command="cd /data/course; " + torchrun_command("train.py", "--checkpoint",
                                                                   "/data/ckpt/c.pt", nproc_per_node=8,
                                                                   master=True),
                    gpus=8, workers=1, pvc="aiteam", cpu=7, memory="64Gi",  # + the master pod
                    env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": 1})
    settings.update(changes)
    return submit_command("digits-capstone", image, "aiteam", **settings)


@pytest.mark.processes   # the line is rehearsed: its pods' shells run
@pytest.mark.parametrize("pods", [dict(), dict(memory="64G"), dict(
    workers=2, master=False, min_replicas=2, max_replicas=2,
    command="cd /data/course; " + torchrun_command("train.py", nproc_per_node=8))])
def test_the_right_runai_line_passes(capsys, pods):
    check_capstone_submit(line(**pods))
    assert "check passed" in capsys.readouterr().out


SUBMIT_PLANTS = {  # a mistake the line check names -> the change to the right line, what it says
    "not a distributed workload": (dict(workers=None), "not a distributed PyTorch workload"),
    "pods not the nodes (a master pod too many)": (dict(workers=2),
                                                  "asks for 3 pods (2 workers and the master pod Run:ai adds)"),
    "pods not the nodes (a worker per GPU)": (dict(workers=16), "asks for 17 pods"),
    "pods not the nodes (no master, too few workers)": (dict(workers=1, master=False),
                                                        "asks for 1 pods (1 workers, no master)"),
    "not all the node's GPUs": (dict(gpus=1), "--gpu-devices-request is 1"),
    "no torchrun": (dict(command="cd /data/course; python3 train.py"), "does not start torchrun"),
    "standalone": (dict(command="cd /data/course; torchrun --standalone --nproc-per-node=8 train.py"), "--standalone"),
    "not one process per GPU": (dict(command="cd /data/course; torchrun --nproc-per-node=1 train.py"),
                                "one process per GPU"),
    "another script": (dict(command="cd /data/course; torchrun --nproc-per-node=8 other.py"), "does not run train.py"),
    "no registry": (dict(image="pretrainingcontainer:latest"), "names no registry"),
    "no registry (a project, no host)": (dict(image="aiteam/pretrainingcontainer:latest"), "names no registry"),
    "memory without a unit": (dict(memory="64"), "without a unit counts bytes"),
    "a shared rendezvous store": (dict(env=None), "its own rendezvous store"),
    "no team volume": (dict(pvc=None), "mount the team's volume"),
}
# What only the rehearsal sees, named by the rehearsal's own table: a plain torchrun meets on its
# own 127.0.0.1 (older operator), a shell keeps the SIGTERM, a job without a master pod that is
# not elastic cannot meet.
REHEARSED = {
    "own-loopback": (dict(command="cd /data/course; torchrun --nproc-per-node=8 train.py"), "own-loopback"),
    "torchrun-not-exec": (dict(command="cd /data/course; " + torchrun_command(
        "train.py", nproc_per_node=8, master=True).removeprefix("exec ") + " && echo done"), "torchrun-not-exec"),
    "no-master-address": (dict(workers=2, master=False), "no-master-address"),
    "own-loopback (no master pod, a plain torchrun)": (
        dict(workers=2, master=False, command="cd /data/course; torchrun --nproc-per-node=8 train.py"),
        "without a master pod"),
}


@pytest.mark.parametrize("name", [*SUBMIT_PLANTS, *REHEARSED])
@pytest.mark.processes   # the line is rehearsed: its pods' shells run
def test_runai_mistakes_are_named(name):
    changes, message = {**SUBMIT_PLANTS, **REHEARSED}[name]
    with names(mistake_of(name), says=re.escape(message)):
        check_capstone_submit(line(**changes))


def test_an_epoch_logged_twice_is_named():
    """A made-up log (no launch): the restart went on from the checkpoint's own epoch and logged it again."""
    from spike_course.lab.launcher import LaunchResult

    job = capstone.two_node_job.Job(result=LaunchResult(nproc=2))
    entries = [{"epoch": 0}, {"epoch": 0}, {"epoch": 1}]
    with names("an epoch logged twice", says=r"holds epochs \[0, 0, 1\]"):
        capstone._judge_table(capstone.METRICS_MISTAKES, job, entries)


PLANTS = {**ALL_MISTAKES, **SUBMIT_PLANTS, "never joined a process group": "test_the_unconverted_script_is_named",
          "an epoch logged twice": "test_an_epoch_logged_twice_is_named",
          "a rank waits for ever": "test_a_hanging_rank_is_stopped_with_a_clear_message"}
