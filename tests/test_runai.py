"""spike_course.runai: the command lines have the form Run:ai documents, and bad jobs are refused."""

import shlex

import pytest

from spike_course.runai import OPERATOR_ENV, describe, submit_command, torchrun_command

IMAGE = "harbor.spike.tue.nl/aiteam/pretrainingcontainer:latest"
JOB = "cd /data; python3 feature_extraction_eval.py --start_index 18999 --end_index 20000"
COMMON = dict(pvc="aiteam", cpu=7, memory="64G")


def test_single_node_line_has_the_guide_flags_in_order():
    line = submit_command("a-test-workload", IMAGE, "aiteam", JOB, gpus=4, **COMMON)
    assert line == (
        f"runai training submit a-test-workload -i {IMAGE} -p aiteam "
        "--existing-pvc claimname=aiteam,path=/data --user-group-source fromTheImage "
        "--cpu-core-limit 7 --cpu-core-request 7 --cpu-memory-limit 64G --cpu-memory-request 64G "
        f"--gpu-devices-request 4 --command -- bash -lc '{JOB}'")


def test_distributed_elastic_line():
    line = submit_command("a-test-workload", IMAGE, "aiteam", JOB, gpus=1, workers=16,
                          min_replicas=1, max_replicas=16, master=False, **COMMON)
    words = shlex.split(line)
    assert words[:4] == ["runai", "training", "pytorch", "submit"]
    assert ("--gpu-devices-request 1 --workers 16 --no-master --min-replicas 1 --max-replicas 16 "
            "--command") in line
    assert words[-3:] == ["bash", "-lc", JOB]  # the shell command survives quoting intact


def test_command_list_and_quoting_survive_a_shell_round_trip():
    cmd = ["python3", "x.py", "--name", "it's here"]
    words = shlex.split(submit_command("job", "img", "proj", cmd, gpus=2))
    assert words[words.index("--") + 1:] == cmd
    assert "--existing-pvc" not in words and "--cpu-core-request" not in words


def test_limits_default_to_requests_and_can_differ():
    words = shlex.split(submit_command("job", "img", "p", "true", cpu=4, cpu_limit=8,
                                       memory="16G", memory_limit="32G"))
    assert words[words.index("--cpu-core-request") + 1] == "4"
    assert words[words.index("--cpu-core-limit") + 1] == "8"
    assert words[words.index("--cpu-memory-limit") + 1] == "32G"


def test_fraction_of_a_gpu_and_cpu_only():
    line = submit_command("job", "img", "p", "true", gpus=0.5)
    assert "--gpu-request-type portion --gpu-portion-request 0.5" in line
    assert "--gpu-devices-request" not in line
    line = submit_command("job", "img", "p", "true", gpus=0, backend="gloo")
    assert "gpu" not in line


@pytest.mark.parametrize("kwargs, reason", [
    (dict(workers=4, min_replicas=3, max_replicas=2), "min_replicas=3 > max_replicas=2"),
    (dict(workers=4, command=None), "needs a command"),
    (dict(workers=4, command=""), "needs a command"),
    (dict(gpus=0), "NCCL"),
    (dict(min_replicas=1, max_replicas=4), "pass workers"),
    (dict(workers=8, min_replicas=1, max_replicas=4, master=False), "outside"),
    # the cluster guide's line: 16 workers + a master = 17 pods for at most 16 nodes
    (dict(workers=16, min_replicas=1, max_replicas=16), "17 pods"),
    (dict(name="My_Job"), "Kubernetes name"),
    (dict(gpus=1.5), "whole GPUs"),
    (dict(memory="64 GB"), "Kubernetes quantity"),
    (dict(cpu=8, cpu_limit=4), "limit below the request"),
])
def test_bad_jobs_raise_with_a_reason(kwargs, reason):
    args = dict(name="job", image="img", project="p", command="python3 train.py")
    args.update(kwargs)
    with pytest.raises(ValueError, match=reason):
        submit_command(**args)


def test_describe_maps_flags_to_ui_fields():
    line = submit_command("job", IMAGE, "aiteam", JOB, workers=2, min_replicas=1,
                          max_replicas=2, master=False, preemptible=True, **COMMON)
    rows = {flag: (value, ui) for flag, value, _, ui in describe(line)}
    assert rows["--workers"][0] == "2"
    assert rows["--no-master"][0] == "" and rows["--preemptibility"][0] == "preemptible"
    assert rows["--existing-pvc"] == ("claimname=aiteam,path=/data", "Data sources: PVC")
    assert rows["--command"][0] == shlex.join(["bash", "-lc", JOB])


def test_torchrun_command_execs_and_leaves_rendezvous_to_the_operator():
    cmd = torchrun_command("train.py", "--epochs", 3, nproc_per_node=4)
    assert cmd == "exec torchrun --nproc-per-node=4 train.py --epochs 3"
    assert "PET_RDZV_ENDPOINT" in OPERATOR_ENV


def test_torchrun_command_meets_at_the_master_and_waits_the_grace_period():
    cmd = torchrun_command("train.py", master=True, shutdown_timeout=71)
    # the pod's shell expands the operator's MASTER_*: torchrun never reads them itself
    assert cmd == ('exec torchrun --nproc-per-node=gpu --shutdown-timeout=71 '
                   '--master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" train.py')
    with pytest.raises(ValueError, match="grace period"):
        torchrun_command("train.py", shutdown_timeout=0)


def test_environment_variables_become_e_flags():
    line = submit_command("job", "img", "p", "true", env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": 1})
    assert "-e TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 --command" in line
    assert ("-e", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") == describe(line)[-2][:2]


def test_operator_env_says_what_world_size_counts_and_when_each_is_set():
    # training-operator >= 1.7: WORLD_SIZE = pods x nprocPerNode, set only with a master pod;
    # the rendezvous variables come only with an elastic policy.
    assert "pods x nprocPerNode" in OPERATOR_ENV["WORLD_SIZE"]
    assert "NOT torchrun's" in OPERATOR_ENV["WORLD_SIZE"]
    assert "NEWER releases only" in OPERATOR_ENV["PET_MASTER_ADDR"]
    assert "master pod" in OPERATOR_ENV["WORLD_SIZE"] and "master pod" in OPERATOR_ENV["RANK"]
    assert all("elastic jobs only" in OPERATOR_ENV[k] for k in OPERATOR_ENV if k.startswith("PET_RDZV"))
    line = submit_command("job", IMAGE, "aiteam", JOB, workers=2, **COMMON)
    (meaning,) = [m for flag, _, m, _ in describe(line) if flag == "--workers"]
    assert "master pod comes on top" in meaning
