"""The warm start server: one process per notebook kernel that imports torch once and forks
every rank of every launch from there (``spike_course.warm`` starts it and talks to it).

A fresh rank spends seconds importing torch before it does a millisecond of work; a rank
forked from this server starts with torch already imported, and then becomes exactly what
``python -u script.py`` would have been: its own session, the launch's environment,
working directory, ``sys.argv``, ``sys.path[0]``, thread counts and a ``__main__`` module,
with its output on a pipe the launcher reads.

Forking is only safe from a process that runs no other thread and has initialised neither
OpenMP nor CUDA (a child would inherit locks held by threads it does not have). The server
imports only third-party modules that no learner edits, starts no thread pool (it imports
them with one OpenMP and one OpenBLAS thread), and proves both before every fork; if either
ever fails it refuses, and the launcher falls back to fresh interpreters.

Messages are JSON over AF_UNIX SOCK_SEQPACKET sockets (one message per packet), with file
descriptors passed alongside (SCM_RIGHTS):

* the control socket, given at start: the server sends {"ready": pid} or {"error": text};
  the kernel sends one empty message per launch carrying that launch's socket. Its end of
  file means the kernel is gone: the server kills every rank and exits.
* a launch socket: the kernel sends {"script", "argv", "cwd", "ranks": [{"rank", "env"}]}
  with one output pipe per rank; the server answers {"pids": [...]} or {"refused": why},
  then {"pid", "exitcode"} as each rank ends. Its end of file kills the launch's ranks.

Linux only (``/proc``, ``prctl``). Standard library at module load; torch when started.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import importlib
import importlib.machinery
import json
import os
import selectors
import signal
import socket
import sys
import threading
import traceback
import types

# Heavy, imported by most worker scripts, never edited by a learner. Ranks import everything
# else (spike_course, the chapter's own helper modules) themselves, fresh from disk.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.nn", "torch.nn.parallel", "torch.optim",
           "torch.utils.data", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.tensor.debug", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.pipelining", "torch.profiler", "torch.utils.checkpoint",
           "torchvision")
# OpenBLAS starts its thread pool when it loads (torch loads numpy): the server loads it with
# one thread, so that no pool thread exists when it forks, and reads its OpenMP default with
# OMP_NUM_THREADS unset (OpenMP starts no thread until a parallel region runs). Each rank
# then takes the counts that a fresh interpreter would take from its environment.
SERVER_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1"}
MAX_MESSAGE = 1 << 20
MAX_FDS = 256
PR_SET_PDEATHSIG = 1


def send(sock: socket.socket, message: dict, fds=()) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


def receive(sock: socket.socket):
    """(message, fds), or (None, []) at end of file (the other end closed or was reset)."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    except ConnectionResetError:
        return None, []
    return (json.loads(data) if data else None), fds


def _tell(launch: socket.socket, message: dict) -> None:
    """Send to a launch that may have ended meanwhile (its end of file then comes through the
    loop, which kills what it left running)."""
    try:
        send(launch, message)
    except OSError:
        pass


def fork_hazards() -> list[str]:
    """Why forking from this process now would be unsafe (empty when it is safe)."""
    hazards = []
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        hazards.append(f"the server runs {threads} threads")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        hazards.append("the server has initialised CUDA")
    return hazards


class Server:
    """The server's loop: start ranks on request, report their exits, kill what is orphaned."""

    def __init__(self, control: socket.socket, torch_threads: int):
        self.control = control
        self.torch_threads = torch_threads
        self.selector = selectors.DefaultSelector()
        self.wake_read, wake_write = os.pipe()
        self.wake_write = wake_write
        os.set_blocking(self.wake_read, False)
        os.set_blocking(wake_write, False)
        self.ranks = {}  # pid -> the launch socket that started it
        self.selector.register(control, selectors.EVENT_READ, "control")
        self.selector.register(self.wake_read, selectors.EVENT_READ, "children")

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_write)  # SIGCHLD wakes select() up
        signal.signal(signal.SIGCHLD, lambda *_: None)
        while True:
            for key, _ in self.selector.select():
                if key.data == "children":
                    self._reap()
                elif key.data == "control":
                    message, fds = receive(self.control)
                    if message is None:  # the kernel is gone: so are its ranks
                        self._kill(list(self.ranks))
                        for pid in self.ranks:
                            os.waitpid(pid, 0)  # SIGKILL: they end at once
                        return
                    self.selector.register(socket.socket(fileno=fds[0]), selectors.EVENT_READ, "launch")
                else:
                    self._serve_launch(key.fileobj)

    def _serve_launch(self, launch: socket.socket) -> None:
        message, fds = receive(launch)
        if message is None:  # the launch is over (or its kernel was interrupted)
            self._kill([pid for pid, owner in self.ranks.items() if owner is launch])
            self.selector.unregister(launch)
            launch.close()
            return
        hazards = fork_hazards()
        if hazards:
            for fd in fds:
                os.close(fd)
            _tell(launch, {"refused": "; ".join(hazards)})
            return
        pids = []
        for rank, out in zip(message["ranks"], fds):
            pid = os.fork()
            if pid == 0:  # the rank: it ends in os._exit, never back in this loop
                try:
                    for other in fds:  # another rank's pipe held open here would hide its end
                        if other != out:
                            os.close(other)
                    self._become_rank(message, rank["env"], out)
                except BaseException:  # e.g. its working directory is gone
                    traceback.print_exc()
                finally:
                    os._exit(1)
            pids.append(pid)
            self.ranks[pid] = launch
        for fd in fds:
            os.close(fd)
        _tell(launch, {"pids": pids})

    def _reap(self) -> None:
        while True:
            try:
                os.read(self.wake_read, 4096)
            except BlockingIOError:
                break
        while self.ranks:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            launch = self.ranks.pop(pid, None)
            if launch is not None:
                _tell(launch, {"pid": pid, "exitcode": os.waitstatus_to_exitcode(status)})

    def _kill(self, pids) -> None:
        for pid in pids:
            for kill in (os.killpg, os.kill):  # its whole session, and itself should setsid lag
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _become_rank(self, message: dict, env: dict, out: int) -> None:
        """In the forked child: drop the server's state, become the rank, run, exit."""
        server = os.getppid()
        os.setsid()  # a session of its own, as launch gives a fresh rank: the tree stops together
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server:  # the server died before prctl took effect
            os._exit(1)
        signal.set_wakeup_fd(-1)
        _signals_as_fresh(message["ignored_signals"])
        for key in list(self.selector.get_map().values()):
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()
        self.selector.close()
        os.close(self.wake_read)
        os.close(self.wake_write)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(devnull)
        os.close(out)
        _take_fresh_thread_counts(env, self.torch_threads)
        os.chdir(message["cwd"])
        os.environ.clear()  # exactly the launch's environment, none of the server's
        os.environ.update(env)
        _forget_what_a_fresh_interpreter_has_not_loaded()
        sys.argv = [message["script"], *message["argv"]]
        sys.path[0] = os.path.dirname(os.path.realpath(message["script"]))  # as Python sets it
        _exit_like_python(*_run_as_main(os.path.abspath(message["script"])))


def _signals_as_fresh(ignored: list[int]) -> None:
    """Signal handling as a fresh interpreter started by the launcher would have it: what the
    launcher ignores stays ignored across exec, the rest is reset; then Python ignores
    SIGPIPE and SIGXFSZ and turns SIGINT into KeyboardInterrupt, unless SIGINT is ignored."""
    for signum in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
        try:
            signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
        except (OSError, ValueError):  # one the C library keeps for itself
            pass
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(signum, signal.SIG_IGN)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _take_fresh_thread_counts(env: dict, torch_default: int) -> None:
    """Thread counts as a fresh interpreter would take them from this environment.

    ``torch_default`` is the server's own count, read with OMP_NUM_THREADS unset: MKL's
    (every physical core, or MKL_NUM_THREADS). A fresh torch takes OMP_NUM_THREADS up to
    that many, unless MKL_NUM_THREADS is set.
    """
    import torch

    omp = env.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0 and "MKL_NUM_THREADS" not in env:
        threads = min(int(omp), torch_default)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
    # OpenBLAS (numpy's) reads its count once, when it loads: OPENBLAS_NUM_THREADS, else
    # GOTO_NUM_THREADS, else OMP_NUM_THREADS, else every CPU.
    for name in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        if env.get(name, "").isdigit() and int(env[name]) > 0:
            blas = int(env[name])
            break
    else:
        blas = os.cpu_count() or 1
    blas = min(blas, os.cpu_count() or 1)
    if blas != 1:
        import threadpoolctl

        threadpoolctl.threadpool_limits(blas, user_api="blas")
        # Its import sets KMP_DUPLICATE_LIB_OK (the environment is replaced after this); a
        # script that imports it runs that import itself.
        del sys.modules["threadpoolctl"]


def _forget_what_a_fresh_interpreter_has_not_loaded() -> None:
    """The rank imports spike_course and the chapter's helpers from disk, as a fresh one
    would (edited since the server started or not), and draws its own random numbers."""
    for name in [name for name in sys.modules if name == "spike_course" or name.startswith("spike_course.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    # A fresh interpreter seeds torch's and numpy's global generators from the OS; the random
    # module reseeds itself in a forked child.
    sys.modules["torch"].default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _run_as_main(path: str):
    """Run the script at absolute ``path`` as ``python path`` does: a new ``__main__``. Returns
    (exit code, the exception that ended it or None, the module)."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None, __annotations__={},
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    try:
        with open(path, "rb") as source:
            code = compile(source.read(), path, "exec")
        exec(code, main.__dict__)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0, None, main
        print(stop.code, file=sys.stderr)
        return 1, None, main
    except BaseException as error:  # printed as the interpreter prints it, without our frames
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next
        # The hook prints error.__traceback__; its own tb argument only when that is None.
        error.__traceback__ = tb or error.__traceback__
        sys.excepthook(type(error), error, error.__traceback__)
        return 1, error, main
    return 0, None, main


def _exit_like_python(code: int, error, main) -> None:
    """What the interpreter does at exit, up to the point where only its own teardown is left
    (which takes a torch process most of a second): join non-daemon threads, run atexit
    handlers, release the script's objects (an unclosed file gets flushed), flush."""
    threading._shutdown()
    atexit._run_exitfuncs()
    main.__dict__.clear()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if isinstance(error, KeyboardInterrupt):  # the interpreter ends itself with SIGINT then
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def main(control_fd: int) -> None:
    control = socket.socket(fileno=control_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's Ctrl-C is for the launcher
    try:
        for name in PRELOAD:
            importlib.import_module(name)
        torch_threads = sys.modules["torch"].get_num_threads()
        hazards = fork_hazards()
        if hazards:
            raise RuntimeError("after its imports, " + "; ".join(hazards))
    except Exception:
        _tell(control, {"error": traceback.format_exc(limit=-3)})
        return
    try:
        send(control, {"ready": os.getpid()})
    except OSError:  # the kernel ended while we imported (a chapter with no launch): so do we
        return
    Server(control, torch_threads).serve()


if __name__ == "__main__":
    main(int(sys.argv[1]))
