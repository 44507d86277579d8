"""The launcher's contract (README, "How a chapter runs distributed code"): results, failures,
timeouts, no orphans, for each way of starting ranks (warm, fresh, torchrun)."""

import threading
import time

import pytest

from spike_course import LaunchError, launch

pytestmark = pytest.mark.processes  # most tests here start ranks, torchrun or kernels

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


LAUNCHERS = ["warm", "fresh", "torchrun"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
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
    from spike_course.lab.launcher import LaunchResult, _failure

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


@pytest.mark.parametrize("launcher", LAUNCHERS)
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


# A learner's bug two frames deep, raised while handling another exception.
FAILS_DEEP = """
def inner():
    raise ValueError("inner fails")

def outer():
    try:
        inner()
    except ValueError as error:
        raise RuntimeError("outer fails") from error

outer()
"""


def test_a_warm_rank_prints_the_traceback_a_fresh_rank_prints(worker, no_orphans):
    script = worker(FAILS_DEEP)
    warm, fresh = (launch(script, nproc=1, launcher=launcher, echo=False, check=False).output[0]
                   for launcher in ("warm", "fresh"))
    assert warm == fresh
    assert warm[0] == "Traceback (most recent call last):" and warm[-1] == "RuntimeError: outer fails"
    assert not [line for line in warm if "warm_server" in line], "the helper's own frames are shown"


@pytest.mark.parametrize("launcher", ["warm", "fresh"])
def test_a_hanging_worker_times_out(worker, no_orphans, launcher):
    started = time.perf_counter()
    with pytest.raises(LaunchError, match="timed out after 2 s"):
        launch(worker(HANG), nproc=2, timeout=2, echo=False, launcher=launcher)
    assert time.perf_counter() - started < 20


# Rank 1 is killed outright (as the kernel's OOM killer would) while rank 0 waits for it.
KILLED_IN_COLLECTIVE = """
import os, signal, torch, torch.distributed as dist
from spike_course import runtime
ctx = runtime.setup(timeout=600)
if ctx.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(torch.zeros(1))
"""


@pytest.mark.parametrize("launcher", ["warm", "fresh"])
def test_a_rank_killed_by_a_signal_is_named_with_its_signal(worker, no_orphans, launcher):
    with pytest.raises(LaunchError, match="rank 1 failed with exit code -9") as caught:
        launch(worker(KILLED_IN_COLLECTIVE), nproc=2, launcher=launcher, echo=False, timeout=120)
    assert caught.value.rank == 1 and caught.value.result.returncodes[1] == -9


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
    with pytest.raises(ValueError, match="nodes must be a whole number"):
        launch(worker(HELLO), nodes=0)


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
    from spike_course.lab import progress

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

# A notebook kernel turns SIGINT (the stop button) into KeyboardInterrupt, even when it was
# started with SIGINT ignored (as a background job's children are).
DRIVER = """
import signal, sys
from spike_course import launch
signal.signal(signal.SIGINT, signal.default_int_handler)
launch(sys.argv[1], nproc=2, launcher=sys.argv[2], timeout=300)
"""


@pytest.mark.parametrize("how", ["interrupt", "kill"])
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_interrupt_or_crash_of_the_notebook_leaves_no_rank(worker, launcher, how):
    """Ctrl-C in the cell (SIGINT), or a dead kernel (SIGKILL): no rank survives either, nor
    the warm start server or torchrun's agent: every process the notebook's launch started."""
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
    started = psutil.Process(parent.pid).children(recursive=True)
    assert len(started) >= 2
    parent.send_signal(signal.SIGINT if how == "interrupt" else signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 15
    while _running(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _running(started)
    for proc in left:
        proc.kill()
    assert not left, f"{[p.pid for p in left]} of {[p.pid for p in started]} outlived the {how} of their launcher"


def _running(processes):
    """Those still running (a zombie has ended: it waits only for its exit code to be read)."""
    import psutil

    running = []
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                running.append(proc)
        except psutil.NoSuchProcess:
            pass
    return running


# --- the warm start: ranks forked from a server that imported torch once ------------------

# Everything a rank can see of how it was started, read before it imports anything heavy.
REPORT_HOW_I_WAS_STARTED = """
import os
ENVIRONMENT = dict(os.environ)
import signal, sys
import __main__
import threadpoolctl, torch
from spike_course import runtime

runtime.report(
    env={k: v for k, v in ENVIRONMENT.items() if k not in ("MASTER_PORT", "SPIKE_COURSE_RESULTS_DIR")},
    threads=torch.get_num_threads(), interop_threads=torch.get_num_interop_threads(),
    blas_threads=sorted((i["internal_api"], i["num_threads"]) for i in threadpoolctl.threadpool_info()),
    cwd=os.getcwd(), argv=sys.argv, path=sys.path, file=__file__, name=__name__,
    main_is_this_module=sys.modules["__main__"] is __main__,
    main_names=sorted(name for name in vars(__main__) if name.startswith("__")),
    loader=type(__loader__).__name__, spec=__spec__, flags=str(sys.flags),
    own_session=os.getsid(0) == os.getpid(), stdin=sys.stdin.read(),
    stdout_is_stderr=os.readlink("/proc/self/fd/1") == os.readlink("/proc/self/fd/2"),
    open_fds=sorted(os.listdir("/proc/self/fd")),
    signals={s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD,
                                                         signal.SIGPIPE, signal.SIGUSR1)},
    cuda_initialized=torch.cuda.is_initialized(), grad_enabled=torch.is_grad_enabled(),
    stdout_encoding=sys.stdout.encoding, course_modules_loaded_at_start=sorted(
        m for m in sys.modules if m.startswith("spike_course") and m != "spike_course.runtime"
        and m != "spike_course.protocol" and m != "spike_course"),
    # drawn from generators that a fresh interpreter seeds from the OS: compared across ranks
    draws=[__import__("random").random(), __import__("numpy").random.rand(), torch.initial_seed()],
)
"""


@pytest.mark.parametrize("nproc, omp_threads", [(1, None), (3, None), (2, 3)])
def test_a_warm_rank_sees_what_a_fresh_rank_sees(worker, no_orphans, nproc, omp_threads):
    script = worker(REPORT_HOW_I_WAS_STARTED, "report.py")
    runs = {how: launch(script, nproc=nproc, args=["--flag", "a b"], launcher=how, echo=False,
                        omp_threads=omp_threads).reports for how in ("fresh", "warm")}
    draws = {how: [tuple(reports[rank].pop("draws")) for rank in range(nproc)] for how, reports in runs.items()}
    for rank in range(nproc):
        fresh, warm_ = runs["fresh"][rank], runs["warm"][rank]
        assert warm_ == fresh, {k: (fresh[k], warm_[k]) for k in fresh if fresh[k] != warm_[k]}
    # Each rank seeds its own generators from the OS, as a fresh interpreter does.
    assert len(set(draws["fresh"] + draws["warm"])) == 2 * nproc, draws


def test_a_helper_module_edited_between_launches_takes_effect(worker, no_orphans):
    """The server imports only torch and its kin: a worker's own modules, and spike_course,
    are imported fresh by every rank."""
    script = worker("import helper\nfrom spike_course import runtime\nruntime.report(answer=helper.ANSWER)\n")
    helper = script.parent / "helper.py"
    helper.write_text("ANSWER = 1\n")
    assert launch(script, nproc=2, echo=False).reports[1] == {"answer": 1}
    helper.write_text("ANSWER = 'edited'\n")
    assert launch(script, nproc=2, echo=False).reports[1] == {"answer": "edited"}


# The rank prints, then waits until the test has seen that line in the cell's output.
PRINT_THEN_WAIT = """
import os, sys, time
print("waiting for the notebook to see this line", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
print("released" if os.path.exists(sys.argv[1]) else "never released", flush=True)
"""


@pytest.mark.parametrize("launcher", ["warm", "fresh"])
def test_output_reaches_the_cell_while_the_rank_runs(worker, tmp_path, monkeypatch, launcher):
    import io
    import sys

    seen = tmp_path / "seen"

    class Cell(io.StringIO):
        def write(self, text):
            if "[rank 0] waiting for the notebook" in text:
                seen.touch()
            return super().write(text)

    cell = Cell()
    monkeypatch.setattr(sys, "stdout", cell)
    result = launch(worker(PRINT_THEN_WAIT), nproc=1, args=[seen], launcher=launcher, timeout=120)
    assert result.output[0] == ["waiting for the notebook to see this line", "released"]
    assert "[rank 0] released" in cell.getvalue()


def test_launches_share_one_warm_server(worker, no_orphans):
    from spike_course.lab import warm

    script = worker(HELLO)
    launch(script, nproc=2, echo=False)
    servers = warm.server_pids()
    launch(script, nproc=3, echo=False)
    assert warm.server_pids() == servers and len(servers) == 1


# Put on the server's PYTHONPATH: SIGUSR1 makes it start a thread, after which forking
# from it is no longer safe.
THREAD_ON_SIGUSR1 = """
import signal, threading, time
signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=time.sleep, args=(600,), daemon=True).start())
"""


def test_a_server_that_runs_a_thread_refuses_to_fork_and_the_launch_starts_fresh(worker, tmp_path, capsys,
                                                                                  no_orphans):
    import os
    import signal

    from spike_course.lab import warm

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(THREAD_ON_SIGUSR1)
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    script = worker(HELLO)
    before = set(warm.server_pids())
    assert launch(script, nproc=2, env=env).ok  # warm: this environment gets its own server
    assert "fresh interpreters" not in capsys.readouterr().out
    (server,) = set(warm.server_pids()) - before
    os.kill(server, signal.SIGUSR1)
    time.sleep(1)
    result = launch(script, nproc=2, env=env)
    printed = capsys.readouterr().out
    assert result.ok and result.reports[1]["total"] == 1.0
    assert ("[launch] starting fresh interpreters: the warm start server refused to fork "
            "(the server runs 2 threads)") in printed
    assert server not in warm.server_pids()  # a tainted server is not used again


def test_fork_hazards_name_threads_and_cuda():
    import subprocess
    import sys

    program = """
import sys, threading, time, types
from spike_course.lab.warm_server import fork_hazards

print(fork_hazards())
threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
print(fork_hazards())
sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
print(fork_hazards())
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == [
        "[]", "['the server runs 2 threads']",
        "['the server runs 2 threads', 'the server has initialised CUDA']"], done.stderr


def test_where_fork_is_unsafe_the_launch_starts_fresh_and_says_why(worker, monkeypatch, capsys):
    from spike_course.lab import warm

    monkeypatch.setattr(warm.sys, "platform", "darwin")
    result = launch(worker(HELLO), nproc=2)
    assert result.ok
    assert "[launch] starting fresh interpreters: fork is not safe on darwin (Linux only)" in capsys.readouterr().out


def test_a_server_that_died_is_replaced_at_the_next_launch(worker, no_orphans):
    import os
    import signal

    from spike_course.lab import warm

    script = worker(HELLO)
    launch(script, nproc=2, echo=False)
    dead = warm.server_pids()
    for server in dead:
        os.kill(server, signal.SIGKILL)  # as the kernel's out-of-memory killer would
    time.sleep(0.5)
    assert launch(script, nproc=2, echo=False).reports[1]["total"] == 1.0
    assert warm.server_pids() and not set(dead) & set(warm.server_pids())


def test_the_launch_cell_and_the_check_name_the_same_failed_rank():
    """One reading of a failure (LaunchResult.failure): rank 0 ended first, but its error only
    echoes rank 1's lost connection; the launch's message and the check both name rank 1."""
    from spike_course.checks import CheckFailed, launch_reports
    from spike_course.lab.launcher import LaunchResult, _failure

    result = LaunchResult(nproc=2, returncodes={0: 1, 1: 1}, exit_order=[0, 1], output={
        0: ["RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234"],
        1: ["Traceback (most recent call last):", "ValueError: the batch does not divide"]})
    assert (result.failure.rank, result.failure.code, result.failure.blank) == (1, 1, False)
    assert str(_failure(result, 10)).startswith("rank 1 failed with exit code 1")
    with pytest.raises(CheckFailed, match=r"rank 1 failed \(exit code 1\) before it reported: ValueError: the batch"):
        launch_reports(result, "the worker")


WHERE = """
import os, time
from spike_course import runtime
ctx = runtime.setup()
print(f"rank {ctx.rank} local {os.environ['LOCAL_RANK']} node {os.environ['GROUP_RANK']} in {os.getcwd()}")
runtime.teardown()
"""


# Under torchrun two agents meet; a fresh (or warm) launch gives the ranks what the agents would.
@pytest.mark.parametrize("launcher", ["torchrun", "fresh"])
def test_two_nodes_number_their_ranks_as_a_cluster_does(worker, no_orphans, tmp_path, launcher):
    result = launch(worker(WHERE), nproc=2, launcher=launcher, nodes=2, cwd=tmp_path, echo=False)
    assert result.ok and sorted(result.output) == [0, 1, 2, 3]
    said = {rank: lines[0].split() for rank, lines in result.output.items()}
    assert {rank: (int(words[3]), int(words[5])) for rank, words in said.items()} == \
        {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)}  # LOCAL_RANK and the node, each line under its rank
    assert all(words[-1] == str(tmp_path) for words in said.values())


class Enough(Exception):
    pass


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_what_watch_raises_stops_every_rank_and_comes_out(worker, no_orphans, launcher):
    seen = []

    def watch(result):
        seen.append(sum(len(lines) for lines in result.output.values()))
        if seen[-1]:  # a rank said it is about to hang: judged enough
            raise Enough

    started = time.monotonic()
    with pytest.raises(Enough):
        launch(worker(HANG), nproc=2, launcher=launcher, echo=False, watch=watch, watch_every=0.05, timeout=60)
    assert time.monotonic() - started < 30 and seen[-1] > 0
