"""Warm starts for ``launch``: ranks forked from a server that has imported torch already.

The launching process (a notebook kernel, pytest) keeps one server per Python and
environment (``warm_server`` is its program), started on first use, or earlier by
``prestart()`` while a chapter's first cells run. ``start_ranks`` asks it for one launch's
ranks and returns them as :class:`WarmRank` handles, which the launcher drives as it drives
``subprocess.Popen`` objects: ``pid``, ``stdout``, ``poll()``, ``wait()``, ``returncode``.

The server is tied to this process: when it exits or is killed, the server's control socket
reaches its end and the server kills every rank it started, then exits. Where a warm start
cannot be had (not Linux, a server that failed to start or refuses to fork), ``start_ranks``
says why in one line and returns None, and the launcher starts fresh interpreters.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from ..protocol import DATA_FALLBACK_SAID_ENV
from .warm_server import SERVER_THREAD_ENV, receive, send

READY_TIMEOUT = 300  # seconds for a server to import torch on a loaded 2-core machine
KEPT_SERVERS = 2     # one per environment in use (about 0.9 GB each); a third replaces the least used
# Variables that the server's imports do not read: what one launch sets differently from the
# next (pytest names the running test), and two that libraries set in the launching process
# when it imports them (inductor's cache folder, threadpoolctl's flag for Intel's OpenMP).
# The server is shared across their values; each rank gets them. Every other variable is
# part of the server's identity: torch reads some of them when it is imported.
NOT_READ_AT_IMPORT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_PORT", "OMP_NUM_THREADS", "SPIKE_COURSE_RESULTS_DIR",
                      "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK",
                      DATA_FALLBACK_SAID_ENV)

_servers: dict = {}
_lock = threading.Lock()


def unavailable_reason(env: dict) -> str | None:
    """Why ranks cannot be forked warm here, or None."""
    if not sys.platform.startswith("linux"):
        return f"fork is not safe on {sys.platform} (Linux only)"
    threads = env.get("OMP_NUM_THREADS", "")
    if not (threads.isdigit() and int(threads) > 0):
        return f"OMP_NUM_THREADS={threads!r} is not a number of threads"
    return None


def server_key(python: str, env: dict) -> tuple:
    return python, tuple(sorted((k, v) for k, v in env.items() if k not in NOT_READ_AT_IMPORT))


class WarmServer:
    """One server process and the socket that ties it to this process."""

    def __init__(self, python: str, env: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server_env = {k: v for k, v in env.items() if k not in NOT_READ_AT_IMPORT}  # OMP_NUM_THREADS too
        self.process = subprocess.Popen(
            [python, "-u", "-m", "spike_course.lab.warm_server", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env={**server_env, **SERVER_THREAD_ENV},
            stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.control = ours
        self.ready: bool | None = None  # None until it said ready or failed
        self.problem = ""
        self._lock = threading.Lock()

    def wait_until_ready(self) -> bool:
        with self._lock:
            if self.ready is None:
                self.control.settimeout(READY_TIMEOUT)
                try:
                    message, _ = receive(self.control)
                except (OSError, ValueError) as error:
                    message = {"error": f"no answer ({error})"}
                self.control.settimeout(None)
                self.ready = bool(message and "ready" in message)
                if not self.ready:
                    self.problem = (message or {}).get("error") or "it exited while starting"
        return self.ready

    def open_launch(self) -> socket.socket:
        """A socket of the server's for one launch."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with self._lock:
            send(self.control, {}, [theirs.fileno()])
        theirs.close()
        return ours

    def close(self) -> None:
        self.control.close()  # end of file: the server kills its ranks and exits
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _server(python: str, env: dict) -> WarmServer:
    key = server_key(python, env)
    with _lock:
        server = _servers.pop(key, None)  # put back last: the least recently used goes first
        if server is None or server.process.poll() is not None:
            if len(_servers) >= KEPT_SERVERS:
                _servers.pop(next(iter(_servers))).close()
            server = WarmServer(python, env)
        _servers[key] = server
    return server


def _forget(server: WarmServer) -> None:
    with _lock:
        for key, kept in list(_servers.items()):
            if kept is server:
                del _servers[key]
    server.close()


def prestart(python: str, env: dict) -> None:
    """Start the server for this environment now, so the first launch finds torch imported."""
    if unavailable_reason(env) is None:
        _server(python, env)


def server_pids() -> list[int]:
    """The servers alive now (tests tell them from ranks left behind)."""
    return [server.process.pid for server in list(_servers.values()) if server.process.poll() is None]


@atexit.register
def shut_down_servers() -> None:
    while _servers:
        _servers.pop(next(iter(_servers))).close()


def start_ranks(python: str, script: str, args: list, env: dict, rank_envs: dict, cwd: str) -> dict | None:
    """Fork one rank per entry of ``rank_envs`` ({rank: its variables}) running ``script`` with
    ``args`` in ``cwd``; {rank: WarmRank}, or None (and one printed line saying why) to start fresh."""
    ranks, why = _fork_ranks(python, script, args, env, rank_envs, cwd)
    if ranks is None:
        print(f"[launch] starting fresh interpreters: {why}", flush=True)
    return ranks


def _fork_ranks(python, script, args, env, rank_envs, cwd) -> tuple[dict | None, str]:
    why = unavailable_reason(env)
    if why:
        return None, why
    server = _server(python, env)
    if not server.wait_until_ready():
        _forget(server)
        return None, f"the warm start server did not start: {server.problem.strip().splitlines()[-1]}"
    envs = {rank: {**env, **extra} for rank, extra in rank_envs.items()}
    try:
        job = WarmJob(server.open_launch())
        ranks = job.start(script, args, cwd, envs)
        why = f"the warm start server refused to fork ({job.refused})"
    except OSError as error:  # it died since the last launch (killed, out of memory)
        ranks, why = None, f"the warm start server stopped ({error})"
    if ranks is None:
        _forget(server)  # a refusing server stays unsafe: the next launch starts another
    return ranks, why


def _ignored_signals() -> list[int]:
    """The signals this process ignores, which a fresh rank would inherit (subprocess resets
    SIGPIPE and SIGXFSZ, which Python itself ignores, before it starts a program)."""
    ignored = []
    for signum in signal.valid_signals() - {signal.SIGPIPE, signal.SIGXFSZ}:
        try:
            if signal.getsignal(signum) is signal.SIG_IGN:
                ignored.append(int(signum))
        except ValueError:
            pass
    return ignored


class WarmJob:
    """One launch's socket to the server, and the exit codes that arrive on it."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.exitcodes: dict = {}  # pid -> exit code, in the order the server reported them
        self.refused = ""
        self.closed = False

    def start(self, script: str, args: list, cwd: str, envs: dict) -> dict | None:
        pipes = {rank: os.pipe() for rank in envs}
        request = {"script": str(script), "argv": [str(a) for a in args], "cwd": cwd,
                   "ignored_signals": _ignored_signals(),
                   "ranks": [{"rank": rank, "env": env} for rank, env in envs.items()]}
        send(self.sock, request, [write for _, write in pipes.values()])
        for _, write in pipes.values():
            os.close(write)
        answer, _ = receive(self.sock)
        if not answer or "pids" not in answer:
            self.refused = (answer or {}).get("refused", "it closed the launch")
            for read, _ in pipes.values():
                os.close(read)
            self.close()
            return None
        return {rank: WarmRank(pid, open(pipes[rank][0], "rb"), self)
                for rank, pid in zip(envs, answer["pids"])}

    def collect(self, timeout: float | None) -> None:
        """Record the exit codes the server has sent, waiting at most ``timeout`` for one."""
        if self.closed:
            return
        self.sock.settimeout(timeout)
        try:
            while True:
                message, _ = receive(self.sock)
                if message is None:  # the server died: its ranks died with it (SIGKILL)
                    self.closed = True
                    return
                self.exitcodes[message["pid"]] = message["exitcode"]
                self.sock.settimeout(0)
        except (BlockingIOError, socket.timeout):
            return
        finally:
            if not self.closed:
                self.sock.settimeout(None)

    def close(self) -> None:
        self.closed = True
        self.sock.close()  # the server kills whatever of this launch still runs


class WarmRank:
    """A forked rank, driven like a ``subprocess.Popen``: the launcher reads ``stdout``,
    polls, stops the tree under ``pid`` and waits. Its parent is the server, which reports
    its exit code."""

    def __init__(self, pid: int, stdout, job: WarmJob):
        self.pid, self.stdout, self.job = pid, stdout, job
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            self.job.collect(timeout=0)
            self._settle()
        return self.returncode

    def wait(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            self.job.collect(timeout=left if left is None else min(left, 0.5))
        return self.returncode

    @property
    def exit_sequence(self) -> int:
        """How many ranks of this launch had ended before this one (the server reaps in order)."""
        return list(self.job.exitcodes).index(self.pid) if self.pid in self.job.exitcodes else len(self.job.exitcodes)

    def _settle(self):
        if self.pid in self.job.exitcodes:
            self.returncode = self.job.exitcodes[self.pid]
        elif self.job.closed:
            self.returncode = -9  # SIGKILLed with the server
