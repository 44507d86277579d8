"""Start N ranks of a worker script from a notebook or a shell, and collect what they say.

Three ways to start the ranks:

* ``launcher="warm"`` (the default) forks every rank from a server process that has
  imported torch once (``spike_course.lab.warm``): a 2-rank job starts in a fraction of a
  second instead of several. Each rank then sees exactly what a fresh one would: RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT as torchrun sets them, the rest of the
  environment, thread counts, working directory, ``sys.argv`` and ``__main__``. Where
  forking is not safe (macOS; a server that ran threads or touched CUDA) it says so in one
  line and starts fresh interpreters instead.
* ``launcher="fresh"`` starts ``nproc`` plain ``python script.py`` processes with the same
  variables; each imports torch itself.
* ``launcher="torchrun"`` runs ``python -m torch.distributed.run`` with ``--standalone``
  or with the rendezvous options you pass (``nnodes``, ``max_restarts``, ``rdzv_backend``,
  ``rdzv_endpoint``, ...), which is how the same script is started on a cluster.

Whichever, the output of every rank streams into the cell, one whole line at a time,
tagged with its rank; whatever a rank passes to ``spike_course.runtime.report`` comes
back in ``result.reports[rank]``; and no child process outlives the call: a failing
rank, a timeout or an interrupted cell stops the whole process tree.
"""

from __future__ import annotations

import ctypes
import os
import random
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from . import warm
from .progress import ProgressView
from ..protocol import COLLECTIVE_TIMEOUT_ENV, PARENT_PID_ENV, RESULTS_DIR_ENV, read_results

LAUNCHERS = ("warm", "fresh", "torchrun")
TAIL_LINES = 25
# A collective that waits longer than this inside a notebook launch is a bug (a rank skipped
# it), not slow work: fail within a minute instead of gloo's 30 (runtime.setup reads it).
NOTEBOOK_COLLECTIVE_TIMEOUT = 60

# torchrun's --tee prefixes each worker line with "[<role><local_rank>]:", or with
# "[<role><local_rank>]:[rank<global_rank>]:" once the workers' ranks are known.
_TORCHRUN_LINE = re.compile(r"^\[[A-Za-z_]*?(\d+)\]:(?:\[rank(\d+)\]: ?)?(.*)$")
# torch itself prefixes the errors it prints with "[rank<N>]: "; our tag already says it.
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
# torchrun's failure summary: "rank      : 1 (local_rank: 1)" followed by "exitcode  : 1".
_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank.*?exitcode\s*:\s*(-?\d+)", re.S)


class LaunchError(RuntimeError):
    """A launch that did not end with every rank exiting 0."""

    def __init__(self, message: str, rank: int | None = None, exit_code: int | None = None,
                 result: "LaunchResult | None" = None):
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code
        self.result = result


_ERROR_LINE = re.compile(r"\s*[\w.]*(Error|Exception|Interrupt)\b")
_ECHO = "closed by peer"  # what the other ranks say when the failed rank's connection went away


@dataclass
class Failure:
    """Why a launch failed, read once: the rank whose error started it, its exit code, its last
    error line ("(no error line)" if it printed none), and whether a rank stopped at an
    exercise's ``raise NotImplementedError`` (a blank, not a bug)."""

    rank: int | None
    code: int | None
    error: str
    blank: bool


@dataclass
class LaunchResult:
    """What a launch gave back. ``reports[r]`` is what rank r reported, ``output[r]`` the
    lines it printed, ``returncodes[r]`` its exit code: every dict is keyed by rank. Under
    ``launcher="torchrun"`` the agent's own lines (rendezvous, restarts, its failure
    summary) are ``agent_output`` and its exit code ``agent_returncode``."""

    nproc: int
    returncodes: dict = field(default_factory=dict)
    reports: dict = field(default_factory=dict)
    output: dict = field(default_factory=dict)
    seconds: float = 0.0
    timed_out: bool = False
    agent_output: list = field(default_factory=list)
    agent_returncode: int | None = None
    exit_order: list = field(default_factory=list)  # ranks that ended by themselves, first first

    @property
    def ok(self) -> bool:
        return (not self.timed_out and len(self.returncodes) > 0
                and all(code == 0 for code in self.returncodes.values())
                and self.agent_returncode in (None, 0))

    @property
    def failure(self) -> Failure | None:
        """Why the launch failed (None if it did not): the launch cell's message and every check
        name the same rank. The first rank that ended with an error by itself, in the order the
        ranks ended; the others' errors ("Connection closed by peer") are usually its echo, so a
        rank whose last error is such an echo comes after one with an error of its own."""
        if self.ok:
            return None
        failed = [r for r in self.exit_order if self.returncodes.get(r) not in (0, None)]
        if not failed:
            others = [(r, c) for r, c in sorted(self.returncodes.items()) if c not in (0, None)]
            failed = [r for r, c in others if c > 0] or [r for r, _ in others] or sorted(self.output)
        errors = {r: next((line.strip() for line in reversed(self.output.get(r, [])) if _ERROR_LINE.match(line)),
                          "(no error line)") for r in failed}
        own = [r for r in failed if _ECHO not in errors[r]]
        rank = (own or failed or [None])[0]
        blank = any("NotImplementedError" in line for lines in self.output.values() for line in lines)
        return Failure(rank, self.returncodes.get(rank), errors.get(rank, ""), blank)

    def __repr__(self) -> str:
        state = "ok" if self.ok else "FAILED"
        return f"<LaunchResult {state}: {self.nproc} ranks in {self.seconds:.1f} s, reports from ranks {sorted(self.reports)}>"


# Ports are drawn below the range the system hands out to outgoing connections (Linux's
# ip_local_port_range, 32768-60999 by default; macOS's starts at 49152). A port taken with
# bind(0) comes from that range, and between this check and rank 0's bind any connect, gloo's
# among them, could take it as its own end: EADDRINUSE in a full test run on 2 loaded cores.
PORTS_FROM = 20000
_ports = random.SystemRandom()  # not `random`: a notebook seeds it, and two kernels would draw alike


def _outgoing_ports_from() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: macOS's range, or none known
        return 49152


def free_port() -> int:
    """A TCP port nobody listens on right now and no outgoing connection will take, so that two
    launches never collide."""
    below = _outgoing_ports_from()
    for _ in range(100 if below > PORTS_FROM + 1000 else 0):
        port = _ports.randrange(PORTS_FROM, below)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # someone listens there: draw again
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a system whose range starts low
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(script, nproc: int = 2, args=(), *, launcher: str = "warm", timeout: float | None = 300,
           env: dict | None = None, omp_threads: int | None = None, echo: bool = True,
           check: bool = True, progress: bool = True, python: str | None = None, cwd=None,
           nodes: int = 1, watch=None, watch_every: float = 0.25, **torchrun_options) -> LaunchResult:
    """Run ``script`` on ``nproc`` ranks and wait for all of them.

    ``args`` are passed to every rank's ``sys.argv``; ``cwd`` is their working directory (this
    process's by default). ``timeout`` (seconds, None for no limit) bounds the whole run.
    ``echo=False`` keeps the output quiet but still collects it. With ``check=True`` a failure
    raises :class:`LaunchError`; with ``check=False`` it is returned and ``result.ok`` is False.
    Keyword options left over (``nnodes="1:2"``, ``max_restarts=1``, ``rdzv_backend="c10d"``,
    ...) go to torchrun as ``--nnodes 1:2 --max-restarts 1 ...`` and need ``launcher="torchrun"``.
    ``nodes``: ``nproc`` ranks on each of that many pretend nodes, so RANK and LOCAL_RANK differ
    on the second node as on a cluster. Under torchrun that many agents on this machine meet in
    one c10d rendezvous; otherwise the ranks get the variables the agents would give them.
    ``watch(result)`` is called with what the launch has collected so far every ``watch_every``
    seconds while the ranks run: a drill that signals a rank, a check that has judged enough.
    An exception it raises stops every rank and comes out of here.
    """
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(
            f"worker script {str(script)!r} does not exist (looked in {os.getcwd()}). "
            "Run the %%writefile cell that creates it first, or fix the path.")
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be a whole number of ranks >= 1, got {nproc!r}")
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    if torchrun_options and launcher != "torchrun":
        raise ValueError(f"options {sorted(torchrun_options)} are torchrun options: "
                         "pass launcher='torchrun' to use them")
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise ValueError(f"nodes must be a whole number of nodes >= 1, got {nodes!r}")
    args = [str(a) for a in ([args] if isinstance(args, str) else args)]
    if cwd is not None:
        script = script.resolve()  # named from here, run from there

    world = nodes * nproc
    if launcher == "torchrun" and nodes > 1 and not any(key in _RENDEZVOUS for key in torchrun_options):
        # The store lives as long as this call, so that restarted agents meet in it again.
        rendezvous_store, torchrun_options = _host_rendezvous(nodes, torchrun_options)
    results_dir = Path(tempfile.mkdtemp(prefix="spike_course_results_"))
    child_env = _child_env(env, world, omp_threads, results_dir)  # every node is this machine
    python = python or sys.executable
    result = LaunchResult(nproc=world, output={rank: [] for rank in range(world)})
    view = ProgressView(world, results_dir, enabled=progress)
    started = time.perf_counter()
    processes = {}
    try:
        _start(launcher, python, script, args, (nproc, nodes), child_env, torchrun_options, processes,
               str(cwd or os.getcwd()))
        # The clock starts with the ranks: a warm start server still importing torch (once a
        # kernel) is not the job's time.
        _stream(processes, result, launcher, echo, timeout, time.perf_counter(), view, (watch, watch_every))
    finally:
        # Whatever happened (done, failed rank, timeout, KeyboardInterrupt), nothing survives.
        stop_process_tree(list(processes.values()))
        for proc in processes.values():
            if isinstance(proc, warm.WarmRank):
                proc.job.close()
        result.seconds = time.perf_counter() - started
        result.reports = read_results(results_dir)
        view.close()
        shutil.rmtree(results_dir, ignore_errors=True)

    for key, proc in processes.items():
        if not _is_agent(key):
            result.returncodes[key] = proc.returncode
    if launcher == "torchrun":
        codes = [proc.returncode for proc in processes.values()]
        result.agent_returncode = next((code for code in codes if code != 0), 0)  # None: stopped
        _torchrun_returncodes(result)
    if check and not result.ok:
        raise _failure(result, timeout)
    return result


def _start(launcher, python, script, args, shape, child_env, torchrun_options, processes, cwd):
    """Start the ranks (or the torchrun agents, one per node) into ``processes`` ({rank, or
    "node<N>" for an agent: a process handle}), which the caller stops whatever happens."""
    nproc, nodes = shape
    if launcher == "torchrun":
        # Restarted workers otherwise may read the dead workers' store address and fail to
        # connect (pytorch issues 135712 and 167288): let each round start its own store.
        child_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        command = [python, "-m", "torch.distributed.run", *_torchrun_flags(nproc, nodes, torchrun_options),
                   str(script), *args]
        for node in range(nodes):
            processes[f"node{node}"] = _popen(command, child_env, cwd)
        return
    port = str(free_port())
    rank_envs = {rank: {**_rank_env(rank, nproc, nodes), "MASTER_PORT": port} for rank in range(nodes * nproc)}
    if launcher == "warm":
        warm_ranks = warm.start_ranks(python, str(script), args, child_env, rank_envs, cwd)
        if warm_ranks is not None:
            processes.update(warm_ranks)
            return
    for rank, rank_env in rank_envs.items():
        processes[rank] = _popen([python, "-u", str(script), *args], {**child_env, **rank_env}, cwd)


def _is_agent(key) -> bool:
    return isinstance(key, str)  # ranks are keyed by number, torchrun's agents by "node<N>"


def _popen(command, env, cwd):
    return subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)


def prestart_warm_server(python: str | None = None) -> None:
    """Start the warm start server for this process's environment in the background, so that
    the first launch finds torch imported (a chapter's first cell calls this)."""
    warm.prestart(python or sys.executable, _child_env(None, 1, None, ""))


def _child_env(extra, nproc, omp_threads, results_dir):
    child_env = dict(os.environ)
    # Each rank gets its share of the cores; more threads than cores makes CPU training crawl.
    threads = omp_threads or max(1, (os.cpu_count() or 1) // nproc)
    child_env.setdefault("OMP_NUM_THREADS", str(threads))
    child_env.setdefault(COLLECTIVE_TIMEOUT_ENV, str(NOTEBOOK_COLLECTIVE_TIMEOUT))
    child_env.update({
        "PYTHONUNBUFFERED": "1",
        RESULTS_DIR_ENV: str(results_dir),
        PARENT_PID_ENV: str(os.getpid()),
        "MASTER_ADDR": "127.0.0.1",
    })
    child_env.update({k: str(v) for k, v in (extra or {}).items()})
    return child_env


def _rank_env(rank, nproc, nodes=1):
    """What torchrun's agent on node ``rank // nproc`` would give the rank."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % nproc), "WORLD_SIZE": str(nodes * nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(rank // nproc)}


_RENDEZVOUS = ("rdzv_backend", "rdzv_endpoint", "rdzv_id", "nnodes", "master_addr", "master_port")


def _host_rendezvous(nodes, options):
    """The c10d rendezvous store of a launch on several pretend nodes, hosted by this process.

    Left to themselves, agents on one machine each guess they are the endpoint's host and race
    to bind a port that ``free_port`` only saw free; the loser, or both when a third process took
    the port meanwhile, fails with RendezvousConnectionError. A store bound here on port 0 has
    its port before any agent starts, and every agent connects to it as a client
    (``is_host=false``), as the agents of a cluster's second node do.
    """
    from torch.distributed import TCPStore  # only here: a plain launch never imports torch

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    conf = ",".join(filter(None, ["is_host=false", options.get("rdzv_conf")]))
    return store, {**options, "nnodes": nodes, "rdzv_backend": "c10d", "rdzv_id": "spike_course",
                   "rdzv_endpoint": f"127.0.0.1:{store.port}", "rdzv_conf": conf}


def _torchrun_flags(nproc, nodes, options):
    flags = [f"--nproc-per-node={nproc}", "--tee=3"]
    if nodes > 1:  # every line tagged with its global rank: two nodes both have a local rank 0
        flags.append("--log-line-prefix-template=[${role_name}${local_rank}]:[rank${rank}]:")
    if not any(key in _RENDEZVOUS for key in options):  # several nodes: launch's _host_rendezvous
        flags.append("--standalone")
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value not in (None, False):
            flags.append(f"{flag}={value}")
    return flags


def _die_with_parent():
    """Linux only: the child gets SIGKILL if the launching process dies (kernel crash)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _stream(processes, result, launcher, echo, timeout, started, view, watching):
    """Read every child's output in this thread (so it lands in the running cell) until all
    exit, calling ``watch`` every ``watch_every`` seconds (``watching``) meanwhile."""
    watch, watch_every = watching
    watched_at = time.monotonic()
    selector = selectors.DefaultSelector()
    partial = {}
    for key, proc in processes.items():
        os.set_blocking(proc.stdout.fileno(), False)
        selector.register(proc.stdout, selectors.EVENT_READ, key)
        partial[key] = b""

    def emit(key, line):
        _emit(key, line, result, launcher, echo)

    open_pipes = len(processes)
    while open_pipes:
        open_pipes -= _read_ready(selector, partial, emit, wait=0.2 if watch is None else min(0.2, watch_every))
        view.refresh()
        _note_ends(processes, result.exit_order)
        if watch is not None and time.monotonic() >= watched_at + watch_every:
            watched_at = time.monotonic()
            watch(result)
        if launcher != "torchrun" and any(processes[key].returncode != 0 for key in result.exit_order):
            # A rank died: the others would wait forever in their next collective. Its last
            # lines are in its pipe (or held by a process it started: wait 0.5 s at most).
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline and any(
                    selector.get_map().get(processes[key].stdout.fileno()) for key in result.exit_order):
                _read_ready(selector, partial, emit, wait=0.05)
            _read_ready(selector, partial, emit, wait=0, flush=True)
            return
        if timeout is not None and time.perf_counter() - started > timeout:
            result.timed_out = True
            return
    for proc in processes.values():
        proc.wait()
    _note_ends(processes, result.exit_order)


def _note_ends(processes, exit_order):
    """Append the ranks that have ended since the last look, in the order they ended as far
    as can be told: a warm rank's server reports exits in order; fresh ranks are polled."""
    ended = [key for key, proc in processes.items() if key not in exit_order and proc.poll() is not None]
    exit_order += sorted(ended, key=lambda key: getattr(processes[key], "exit_sequence", 0))


def _read_ready(selector, partial, emit, wait, flush=False) -> int:
    """Emit the whole lines that the ready pipes hold; return how many pipes reached their end.

    A line without its newline waits in ``partial`` for the rest, unless its pipe ended or
    ``flush`` says no more will come (the ranks are about to be stopped).
    """
    ended = 0
    for selected, _ in selector.select(timeout=wait):
        key = selected.data
        chunk = selected.fileobj.read()
        if chunk is None:
            continue
        lines = (partial[key] + chunk).split(b"\n")
        partial[key] = lines.pop()
        if (flush or not chunk) and partial[key]:
            lines.append(partial[key])
            partial[key] = b""
        for line in lines:
            emit(key, line.decode(errors="replace"))
        if not chunk:
            selector.unregister(selected.fileobj)
            ended += 1
    return ended


def _emit(key, line, result, launcher, echo):
    rank, text = key, line
    if launcher == "torchrun":
        match = _TORCHRUN_LINE.match(line)
        if not match:  # the agent's own line
            result.agent_output.append(line)
            if echo:
                print(f"[torchrun{'' if key == 'node0' else ' ' + key}] {line}", flush=True)
            return
        local, global_rank, text = match.groups()
        rank = int(global_rank if global_rank is not None else local)
    text = _TORCH_RANK_PREFIX.sub("", text)
    result.output.setdefault(rank, []).append(text)
    if echo:
        print(f"[rank {rank}] {text}", flush=True)


def stop_process_tree(processes, grace: float = 3.0):
    """Terminate each process and all its descendants; kill whatever ignores SIGTERM."""
    victims = []
    for proc in processes:
        try:
            parent = psutil.Process(proc.pid)
            victims += parent.children(recursive=True) + [parent]
        except psutil.NoSuchProcess:
            pass
    for victim in victims:
        try:
            victim.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(victims, timeout=grace)
    for victim in alive:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    for proc in processes:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        if proc.stdout is not None:
            proc.stdout.close()


def _torchrun_returncodes(result):
    """torchrun exits non-zero if any worker failed; its summary names the first one."""
    summary = "\n".join(result.agent_output)
    # The summary lists every stopped rank; the one under "Root Cause" is the one that failed.
    failure = _TORCHRUN_FAILURE.search(summary.split("Root Cause")[-1])
    for rank in range(result.nproc):
        result.returncodes[rank] = 0 if result.agent_returncode == 0 else None
    if result.agent_returncode not in (0, None) and failure:
        result.returncodes[int(failure.group(1))] = int(failure.group(2))


def _failure(result, timeout):
    if result.timed_out:
        running = [r for r, code in result.returncodes.items() if code is None or code < 0]
        return LaunchError(
            f"timed out after {timeout:g} s; stopped ranks {running}. A rank that never returns is "
            "usually waiting in a collective that another rank never entered, or on a recv "
            "that has no matching send. Raise timeout= if the work is just slow.", result=result)
    # Under torchrun, the agent's summary names the failed rank (its returncodes say which).
    failure = result.failure
    if failure.code in (0, None):  # torchrun failed, and its summary named no rank (e.g. the rendezvous failed)
        tail = "\n".join(result.agent_output[-TAIL_LINES:]) or "(no output)"
        return LaunchError(f"torchrun failed with exit code {result.agent_returncode} and named no "
                           f"rank.\n--- last lines of torchrun ---\n{tail}",
                           exit_code=result.agent_returncode, result=result)
    rank, code = failure.rank, failure.code
    tail = "\n".join(result.output.get(rank, [])[-TAIL_LINES:]) or "(no output)"
    return LaunchError(f"rank {rank} failed with exit code {code}; the other ranks were stopped.\n"
                       f"--- last lines of rank {rank} ---\n{tail}", rank=rank, exit_code=code, result=result)
