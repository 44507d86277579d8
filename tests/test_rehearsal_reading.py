"""The rehearsal reads a job line as the cluster would and names each mistake of issue 39's
first section. Each test plants one mistake in an otherwise good line, under the operator
flavour that shows it; the good lines must read clean under both flavours."""

import pytest

pytestmark = pytest.mark.processes  # each read runs the pods' shells (dry tools, about 0.1 s a pod)

from spike_course import rehearsal, runai

TRAIN = "cd /data/course; "


def line(command, **options):
    settings = dict(gpus=2, workers=1, pvc="course", backend="gloo")
    settings.update(options)
    return runai.submit_command("job", "img", "proj", TRAIN + command, **settings)


GOOD_TWO_PODS = line(runai.torchrun_command("train.py", master=True))
GOOD_ELASTIC = line(runai.torchrun_command("train.py"), workers=3, min_replicas=2, max_replicas=4,
                    master=False)
GOOD_ONE_POD = runai.submit_command("one", "img", "proj", TRAIN + runai.torchrun_command(
    "train.py", shutdown_timeout=71), gpus=8, pvc="course", grace_period=71)


@pytest.mark.parametrize("good", [GOOD_TWO_PODS, GOOD_ELASTIC, GOOD_ONE_POD])
def test_the_course_forms_read_clean_under_both_operators(good):
    assert "mistake [" not in rehearsal.ready(good)


def names(text, flavour="older"):
    return rehearsal.mistakes(rehearsal.read(text, flavour))


def test_a_plain_torchrun_meets_on_its_own_loopback_under_the_older_operator():
    plain = line("exec torchrun --nproc-per-node=gpu train.py")
    assert names(plain, "older") == ["own-loopback"]
    assert names(plain, "newer") == []   # PET_MASTER_ADDR is there
    reading = rehearsal.read(plain, "older")
    assert all(run.own_loopback for run in reading.torchruns)
    with pytest.raises(ValueError, match=r"own-loopback \(operator older\)"):
        rehearsal.ready(plain)


def test_the_guides_elastic_line_holds_17_pods_for_16_nodes():
    # written by hand, as the cluster guide has it: --workers 16 and a master pod
    guide = ("runai training pytorch submit big -i img -p proj --gpu-devices-request 8 --workers 16 "
             "--min-replicas 1 --max-replicas 16 --command -- bash -lc 'exec torchrun "
             "--nproc-per-node=gpu train.py'")
    reading = rehearsal.read(guide)
    assert len(reading.job.pods) == 17 and reading.torchruns[0].nnodes == (1, 16)
    assert "pods-against-nnodes" in names(guide)
    assert "17 pods start torchrun" in rehearsal.line_report(reading)
    assert reading.world_size == 16 * 8


def test_the_operators_world_size_is_pods_not_processes():
    reading = rehearsal.read(GOOD_TWO_PODS)
    assert reading.launches[0].environment["WORLD_SIZE"] == "2" and reading.world_size == 4
    assert "advice [operator-world-size]" in rehearsal.line_report(reading)


def test_torchrun_that_is_not_the_pods_first_process_never_gets_sigterm():
    not_last = runai.torchrun_command("train.py", master=True).removeprefix("exec ") + "; echo finished"
    assert names(line(not_last)) == ["torchrun-not-exec"]
    # the last command of `bash -lc` is exec'd by this bash: it works, with advice to say exec
    implicit = line(runai.torchrun_command("train.py", master=True).removeprefix("exec "))
    assert names(implicit) == []
    assert "advice [exec-implicit]" in rehearsal.line_report(rehearsal.read(implicit))


def test_a_grace_period_longer_than_torchruns_shutdown_timeout():
    short = line(runai.torchrun_command("train.py", master=True), grace_period=71)
    assert names(short) == ["shutdown-before-grace"]
    assert "SIGKILLs its ranks 30 s" in rehearsal.line_report(rehearsal.read(short))
    by_env = line(runai.torchrun_command("train.py", master=True), grace_period=71,
                  env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": 71})
    assert names(by_env) == []


@pytest.mark.parametrize("command, options, mistake", [
    ("exec torchrun --standalone --nproc-per-node=gpu train.py", {}, "standalone-several-pods"),
    (runai.torchrun_command("train.py", master=True).replace("exec torchrun", "exec torchrun --node-rank=0"),
     {}, "node-ranks-clash"),
    ('exec torchrun --nproc-per-node=gpu --master-addr="$MASTER_ADDR" --master-port="2950$RANK" train.py',
     {}, "meeting-points-differ"),
    ("exec python3 train.py", {}, "no-torchrun-several-pods"),
    ("cd /nowhere && " + runai.torchrun_command("train.py", master=True), {}, "pod-launches-nothing"),
    ("exec torchrun --nnodes=two train.py", {}, "torchrun-refused"),
    (runai.torchrun_command("train.py", master=True), dict(gpus=0), "no-processes"),
    (runai.torchrun_command("train.py", master=True), dict(extra=["--no-master"]), "no-master-address"),
])
def test_each_mistake_of_a_line_is_named(command, options, mistake):
    assert mistake in names(line(command, **options)) + names(line(command, **options), "newer")


def test_a_bare_command_is_one_node():
    reading = rehearsal.read("torchrun --standalone --nproc-per-node=2 train.py")
    assert reading.job.kind == "command" and reading.world_size == 2
    assert rehearsal.mistakes(reading) == []


@pytest.mark.parametrize("text, problem", [
    ("", "no job given"),
    ("runai training pytorch submit --workers 2", "name must follow"),
    ("runai training submit job -i img", "--command"),
    ("runai training submit job --termination-grace-period soon --command -- true", "duration"),
])
def test_a_line_it_cannot_read_gets_a_clear_error(text, problem):
    with pytest.raises(ValueError, match=problem):
        rehearsal.read(text)


def test_a_slurm_script_is_refused_with_what_to_do_instead():
    with pytest.raises(ValueError, match="Slurm batch script.*torchrun --standalone"):
        rehearsal.read("#!/bin/bash\n#SBATCH --nodes=2\nsrun torchrun train.py\n")


def test_every_run_line_of_the_exported_workers_readme_reads_clean(tmp_path):
    from pathlib import Path

    from spike_course.course import workers

    import re

    workers.export(Path(__file__).resolve().parents[1], tmp_path)
    text = (tmp_path / "README.md").read_text()
    # the indented code lines, and torchrun lines quoted in the prose
    lines = [line.strip() for line in text.splitlines()
             if line.startswith("    ") and line.strip().startswith(("torchrun ", "runai "))]
    lines += re.findall(r"`((?:exec )?torchrun [^`]+)`", text)
    assert len(lines) >= 10 and sum(line.startswith("runai ") for line in lines) == 1, lines
    for line in lines:
        assert rehearsal.mistakes(rehearsal.read(line)) == [], line


def test_every_notebook_that_prints_a_runai_line_rehearses_it():
    # nbval then runs rehearsal.ready on the lines, under both operators; the capstone's
    # exercise line is rehearsed by its check
    import course_files

    printing = 0
    for path in course_files.tracked("notebooks") + course_files.tracked("solutions"):
        source = "\n".join(c.source for c in course_files.notebook(path).cells if c.cell_type == "code")
        if "runai.submit_command(" in source:
            printing += 1
            assert "rehearsal.ready(" in source or "check_capstone_submit(" in source, path
    assert printing >= 7   # 07, 08, 13, 14, 15 and the solutions of 13 and 15
