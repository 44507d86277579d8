"""spike_course.runai: the grace period of a preemptible job (chapter 14)."""

import shlex

import pytest

from spike_course import runai

IMAGE = "harbor.example/team/image:latest"


def test_grace_period_becomes_the_flag_and_describe_reads_it():
    line = runai.submit_command("job", IMAGE, "aiteam", "python3 train.py", gpus=1, grace_period=75)
    words = shlex.split(line)
    assert words[words.index("--termination-grace-period") + 1] == "75s"
    assert words.index("--termination-grace-period") < words.index("--command")
    rows = {flag: (value, meaning) for flag, value, meaning, _ in runai.describe(line)}
    assert rows["--termination-grace-period"][0] == "75s"
    assert "SIGTERM" in rows["--termination-grace-period"][1]


def test_no_grace_period_keeps_the_cluster_default():
    assert "--termination-grace-period" not in runai.submit_command("job", IMAGE, "aiteam", gpus=1)


@pytest.mark.parametrize("bad", [0, -5, 2.5, "60s", True])
def test_a_bad_grace_period_is_refused_with_the_reason(bad):
    with pytest.raises(ValueError, match=r"grace_period=.*whole seconds >= 1"):
        runai.submit_command("job", IMAGE, "aiteam", gpus=1, grace_period=bad)
