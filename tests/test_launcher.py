"""The launcher's contract (README, "How a chapter runs distributed code"): results, failures, timeouts, no orphans."""

import threading
import time

import pytest

from spike_course import LaunchError, launch

HELLO = """
import torch, torch.distributed as dist
from spike_course import runtime
ctx = runtime.setup()
total = torch.tensor([float(ctx.rank)])
dist.all_reduce(total)
print(f"rank {ctx.rank} of {ctx.world_size}: sum of ranks {total.item():g}")
runtime.report(rank=ctx.rank, world_size=ctx.world_size, total=total.item(), device=str(ctx.device))
runtime.teardown()
"""

# Rank 1 raises while every other rank waits in an all-reduce that will never complete.
CRASH_IN_COLLECTIVE = """
import torch, torch.distributed as dist
from spike_course import runtime
ctx = runtime.setup(timeout=600)  # long collective timeout: only the launcher can end this
if ctx.rank == 1:
    raise ValueError("rank 1 fails on purpose")
dist.all_reduce(torch.zeros(1))
"""

HANG = """
import time
print("about to hang", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_results_come_back_from_every_rank(worker, no_orphans, launcher):
    result = launch(worker(HELLO), nproc=3, launcher=launcher, echo=False)
    assert result.ok
    assert sorted(result.reports) == [0, 1, 2]
    for rank in range(3):
        assert result.reports[rank] == {"rank": rank, "world_size": 3, "total": 3.0, "device": "cpu"}
        assert result.output[rank] == [f"rank {rank} of 3: sum of ranks 3"]
    assert sorted(result.output) == sorted(result.returncodes) == [0, 1, 2]  # keyed by rank only
    if launcher == "torchrun":
        assert result.agent_returncode == 0  # its own lines, if any, are in result.agent_output


def test_a_torchrun_failure_that_names_no_rank_is_reported():
    from spike_course.launcher import LaunchResult, _failure

    result = LaunchResult(nproc=2, returncodes={0: None, 1: None}, agent_returncode=1,
                          agent_output=["RendezvousTimeoutError: the rendezvous did not complete"])
    assert not result.ok
    error = _failure(result, timeout=60)
    assert "torchrun failed with exit code 1" in str(error) and "RendezvousTimeoutError" in str(error)


def test_output_is_tagged_with_the_rank(worker, capsys):
    launch(worker(HELLO), nproc=2)
    printed = capsys.readouterr().out.splitlines()
    assert "[rank 0] rank 0 of 2: sum of ranks 1" in printed
    assert "[rank 1] rank 1 of 2: sum of ranks 1" in printed


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_a_crashing_rank_stops_the_others(worker, no_orphans, launcher):
    started = time.perf_counter()
    with pytest.raises(LaunchError) as caught:
        launch(worker(CRASH_IN_COLLECTIVE), nproc=3, launcher=launcher, echo=False, timeout=120)
    elapsed = time.perf_counter() - started
    assert caught.value.rank == 1
    assert caught.value.exit_code == 1
    message = str(caught.value)
    assert "rank 1 failed with exit code 1" in message
    assert "ValueError: rank 1 fails on purpose" in message  # the tail of its traceback
    assert elapsed < 60, f"took {elapsed:.0f} s: the waiting ranks were not stopped"


def test_a_hanging_worker_times_out(worker, no_orphans):
    started = time.perf_counter()
    with pytest.raises(LaunchError, match="timed out after 5 s"):
        launch(worker(HANG), nproc=2, timeout=5, echo=False)
    assert time.perf_counter() - started < 20


def test_check_false_returns_the_failure(worker, no_orphans):
    result = launch(worker(HANG), nproc=1, timeout=2, echo=False, check=False)
    assert not result.ok and result.timed_out
    assert result.output[0] == ["about to hang"]


def test_missing_script_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py.*%%writefile"):
        launch(tmp_path / "nope.py", nproc=2)


@pytest.mark.parametrize("nproc", [0, -1, 1.5, "2"])
def test_nproc_must_be_a_positive_int(worker, nproc):
    with pytest.raises(ValueError, match="nproc must be"):
        launch(worker(HELLO), nproc=nproc)


def test_unknown_launcher_and_misplaced_torchrun_options(worker):
    with pytest.raises(ValueError, match="unknown launcher 'mpirun'"):
        launch(worker(HELLO), launcher="mpirun")
    with pytest.raises(ValueError, match="launcher='torchrun'"):
        launch(worker(HELLO), max_restarts=1)


def test_two_launches_at_the_same_time(worker, no_orphans):
    """Free ports per launch: two jobs on one machine do not collide."""
    script = worker(HELLO)
    results, errors = {}, []

    def run(name):
        try:
            results[name] = launch(script, nproc=2, echo=False)
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert all(results[name].ok and results[name].reports[1]["total"] == 1.0 for name in "ab")


def test_worker_without_launcher_says_how_to_start_it(worker):
    import subprocess
    import sys

    script = worker(HELLO)
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0
    assert "must be started by a launcher" in done.stderr and "torchrun" in done.stderr


def test_cuda_request_without_gpu_is_a_clear_error(worker):
    script = worker("from spike_course import runtime\nruntime.setup(device='cuda')\n")
    with pytest.raises(LaunchError, match="CUDA was asked for"):
        launch(script, nproc=1, echo=False)


def test_unknown_backend_is_a_clear_error(worker):
    script = worker("from spike_course import runtime\nruntime.setup(backend='mpi')\n")
    with pytest.raises(LaunchError, match="unknown backend 'mpi'"):
        launch(script, nproc=1, echo=False)


def test_progress_reaches_the_parent(worker, monkeypatch):
    """Workers' progress reports are read while they run (widgets show them in JupyterLab)."""
    from spike_course import progress

    seen = []
    original = progress.read_progress
    monkeypatch.setattr(progress, "_in_jupyter_kernel", lambda: True)
    monkeypatch.setattr(progress.ProgressView, "_build", lambda self: setattr(self, "_bars", {}))
    monkeypatch.setattr(progress, "read_progress", lambda d: seen.append(original(d)) or seen[-1])
    script = worker("import time\nfrom spike_course import runtime\n"
                    "for step in range(1, 4):\n    runtime.progress(step, 3)\n    time.sleep(0.4)\n")
    launch(script, nproc=2, echo=False)
    final = seen[-1]
    assert final[0]["step"] == 3 and final[1]["total"] == 3


SETUP_THEN_HANG = """
import time
from spike_course import runtime
ctx = runtime.setup()
print("ready", flush=True)
time.sleep(600)
"""

DRIVER = """
import sys
from spike_course import launch
launch(sys.argv[1], nproc=2, launcher=sys.argv[2], timeout=300)
"""


def _processes_running(script):
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if str(script) in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.mark.parametrize("how", ["interrupt", "kill"])
@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_interrupt_or_crash_of_the_notebook_leaves_no_rank(worker, launcher, how):
    """Ctrl-C in the cell (SIGINT), or a dead kernel (SIGKILL): no rank survives either."""
    import signal
    import subprocess
    import sys

    import psutil

    script, driver = worker(SETUP_THEN_HANG), worker(DRIVER, "driver.py")
    parent = subprocess.Popen([sys.executable, str(driver), str(script), launcher],
                              stdout=subprocess.PIPE, text=True)
    ready = 0
    for line in parent.stdout:  # wait until both ranks are up and inside the process group
        ready += "ready" in line
        if ready == 2:
            break
    assert ready == 2
    parent.send_signal(signal.SIGINT if how == "interrupt" else signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 15
    while _processes_running(script) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _processes_running(script)
    for proc in left:
        proc.kill()
    psutil.wait_procs(left, timeout=5)
    assert not left, f"{len(left)} processes outlived the {how} of their launcher"
