"""The rehearsal runs a two-pod line here as the cluster would, preempts it, and names what
went wrong from what the processes did (recorded by the pods' sitecustomize, outside the
job's reach). Two launches plant the run's mistakes, several each; the tables' other
mistakes are planted on recorded runs below, without a launch."""

import shutil
from pathlib import Path

import pytest

from spike_course import rehearsal, runai
from spike_course.rehearsal import findings, running

pytestmark = pytest.mark.processes   # the recorded runs' line is read by its pods' shells too
JOB = Path(__file__).with_name("rehearsal_job")


def two_pods(command, **options):
    settings = dict(gpus=1, workers=1, pvc="course", backend="gloo")
    settings.update(options)
    return runai.submit_command("job", "img", "proj", "cd /data/course; " + command, **settings)


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    folder = tmp_path_factory.mktemp("volume")
    shutil.copytree(JOB, folder / "course")
    return folder


def test_the_agent_kills_a_final_save_longer_than_its_shutdown_timeout(volume):
    # the grace period (8 s) would let a 4 s save finish; torchrun's agent kills it at 2 s
    line = two_pods(runai.torchrun_command(
        "train.py", "--ckpt", "/data/ck.pt", "--save-seconds", 4, "--slip", "same-file", "--slip",
        "outside", master=True), grace_period=8, env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": 2})
    run = rehearsal.rehearse(line, volume=volume, preempt_at=4, timeout=60)
    report = rehearsal.run_report(run)
    assert run.ran and [p.rank for p in run.ranks] == [0, 1], report
    names = rehearsal.mistakes(run)
    assert names == ["shutdown-before-grace", "killed-by-agent", "final-save-lost",
                     "writes-outside-volume", "same-file-many-ranks"], report
    killed = min(run.seconds(p.gone) for p in running_ranks(run)) - run.sigterm_at
    assert 1.5 < killed < 4, report   # at the agent's 2 s, well before the 8 s grace period
    # what is left was saved before the SIGTERM (the slip's shared.pt, after the step-0 ck.pt)
    assert run.checkpoint["path"] == "shared.pt" and run.checkpoint["loads"]
    assert run.checkpoint["written"] < run.sigterm_at
    assert not (volume / "ck.pt").exists()   # the learner's folder is never written


def running_ranks(run):
    return [p for p in run.ranks if p.gone is not None and p.exited is None]


def test_a_shell_that_keeps_sigterm_lets_the_grace_period_kill_a_half_written_save(volume):
    line = two_pods(runai.torchrun_command("train.py", "--ckpt", "/data/ck.pt", "--slip",
                                           "half-written", master=True).removeprefix("exec ")
                    + "; echo finished", grace_period=3)
    run = rehearsal.rehearse(line, volume=volume, preempt_at=3, timeout=60)
    report = rehearsal.run_report(run)
    assert rehearsal.mistakes(run) == ["torchrun-not-exec", "sigterm-missed-torchrun",
                                       "killed-at-grace", "final-save-lost",
                                       "last-checkpoint-broken"], report
    assert all(p.sigterm is None for p in run.processes if p.agent), report
    assert "does NOT load" in report


def recorded(**changes):
    """A finished two-rank run as the rehearsal records it, with ``changes`` planted."""
    line = rehearsal.read(two_pods(runai.torchrun_command("train.py", master=True)))
    ranks = [running.Process(100 + r, pod.name, ["train.py"], False, {"RANK": str(r), "WORLD_SIZE": "2"},
                             started=1.0, exited=5.0, gone=5.0)
             for r, pod in enumerate(line.job.pods)]
    run = running.Run(line, ran=True, began=0.0, ended=6.0, processes=ranks,
                      exit_codes={pod.name: 0 for pod in line.job.pods})
    for key, value in changes.items():
        setattr(run, key, value)
    return run


def test_a_clean_recorded_run_names_nothing():
    assert findings.seen(findings.RUN, recorded()) == []


@pytest.mark.parametrize("plant, name", [
    (lambda run: run.processes.pop(), "pod-never-joined"),
    (lambda run: run.processes[1].environment.update(WORLD_SIZE="1", RANK="0"), "ranks-wrong"),
    (lambda run: run.exit_codes.update({"job-worker-0": 1}), "pod-failed"),
    (lambda run: setattr(run, "timed_out", True) or setattr(run, "killed_at", 120.0), "timed-out"),
])
def test_each_mistake_of_a_recorded_run_is_named(plant, name):
    run = recorded()
    plant(run)
    assert name in [seen for seen, _ in findings.seen(findings.RUN, run)]


def test_the_command_line_runs_a_good_two_pod_line_and_says_so(volume, capsys):
    from spike_course.cli import main

    good = two_pods(runai.torchrun_command("train.py", "--ckpt", "/data/ck.pt", "--steps", 5, master=True))
    assert main(["rehearse", good, "--volume", str(volume), "--timeout", "60"]) == 0
    out = capsys.readouterr().out
    assert "-- under the newer operator (read, not run)" in out and "mistake [" not in out
    assert "rank 0 of 2 in job-master-0: exited" in out and "rank 1 of 2 in job-worker-0: exited" in out
    assert "last checkpoint: ck.pt" in out and ": loads" in out


def test_the_command_line_names_what_it_will_not_run(capsys):
    from spike_course.cli import main

    assert main(["rehearse", two_pods("exec torchrun --nproc-per-node=1 train.py")]) == 1
    out = capsys.readouterr().out
    assert "mistake [own-loopback]" in out and "not run: on the cluster these pods would never" in out
    assert main(["rehearse", "runai training submit --command -- true"]) == 2
