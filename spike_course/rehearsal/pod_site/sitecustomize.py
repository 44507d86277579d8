"""Imported first by every Python process of a rehearsed pod (it is on the pods' PYTHONPATH).

It records, where the job's own code does not look, what the process saw and did: its command
line and the distributed environment when it started, every file it opened for writing or
renamed (an audit hook, which the process cannot remove), when a SIGTERM reached it, and when
it exited normally. One JSON line per event in $SPIKE_REHEARSAL_RECORDS/<pid>.jsonl.

In the torchrun agent it also does what a GPU node would: ``--nproc-per-node=gpu`` (or
``auto``) means the GPUs of the pod, which the rehearsal has hidden so that ranks run gloo.
Standard library only, and silent: a failure here must never change what the job does.
"""
import atexit
import functools
import importlib.util
import json
import os
import signal
import sys
import time

_RECORDS = os.environ.get("SPIKE_REHEARSAL_RECORDS")
_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS",
         "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "CUDA_VISIBLE_DEVICES")
_SKIP = tuple(p for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, "/dev/", "/proc/", "/sys/"} if p)
_busy = []


def _record(event, **values):
    if not _RECORDS or _busy:
        return
    _busy.append(1)  # the hook below sees this open too
    try:
        with open(os.path.join(_RECORDS, f"{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps(dict(event=event, pid=os.getpid(), t=time.time(), **values)) + "\n")
    except OSError:
        pass
    finally:
        _busy.clear()


def _is_agent(argv):
    return ("torch.distributed.run" in argv or "torch.distributed.launch" in argv
            or any(os.path.basename(a) == "torchrun" for a in argv[:2]))


def _gpus_for(value):
    """What torchrun's nproc 'gpu'/'auto' would count in this pod (None: leave it)."""
    gpus = int(float(os.environ.get("SPIKE_REHEARSAL_GPUS", "0")) + 0.999)
    return str(gpus) if value in ("gpu", "auto") and gpus > 0 else None


def _as_on_a_gpu_node():
    argv = sys.argv
    for i, arg in enumerate(argv):
        name, sep, value = arg.partition("=")
        if name in ("--nproc-per-node", "--nproc_per_node"):
            if sep and _gpus_for(value):
                argv[i] = f"{name}={_gpus_for(value)}"
            elif not sep and i + 1 < len(argv) and _gpus_for(argv[i + 1]):
                argv[i + 1] = _gpus_for(argv[i + 1])
    if _gpus_for(os.environ.get("PET_NPROC_PER_NODE")):
        os.environ["PET_NPROC_PER_NODE"] = _gpus_for(os.environ["PET_NPROC_PER_NODE"])


def _audit(event, args):
    try:
        if event == "open" and isinstance(args[1], str) and any(c in args[1] for c in "wax+"):
            path = os.fsdecode(args[0]) if not isinstance(args[0], int) else None
        elif event == "os.rename":
            path = os.fsdecode(args[1])
        else:
            return
        if path is None:
            return
        path = os.path.abspath(path)
        if not path.startswith(_SKIP) and not path.startswith(_RECORDS):
            _record("write" if event == "open" else "rename", path=path,
                    source=os.path.abspath(os.fsdecode(args[0])) if event == "os.rename" else None)
    except Exception:
        pass


_own_handler = signal.SIG_DFL  # the job's SIGTERM handler, which runs after the record
_set_signal = signal.signal    # the real one (signal.signal is replaced below)


def _on_sigterm(signum, frame):
    _record("sigterm")
    if callable(_own_handler):
        return _own_handler(signum, frame)
    if _own_handler != signal.SIG_IGN:  # the default: the process dies of it, as it would have
        _set_signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _signal(signum, handler, _original=_set_signal):
    """signal.signal, except that a SIGTERM handler is kept and run after the record."""
    global _own_handler
    if signum != signal.SIGTERM:
        return _original(signum, handler)
    previous, _own_handler = _own_handler, handler
    return previous


def _join_recorded(module):
    """init_process_group that records when it returns: a preemption drill waits until every
    rank has joined (a rank still importing torch dies of a SIGTERM before its handler exists)."""
    init = module.init_process_group

    @functools.wraps(init)
    def init_process_group(*args, **kwargs):
        result = init(*args, **kwargs)
        _record("joined")
        return result

    module.init_process_group = init_process_group


def _save_recorded(module):
    """torch.save that records the file it writes (its C++ writer opens it unseen by the audit
    hook): the checkpoints are what a preemption drill looks at."""
    save = module.save

    @functools.wraps(save)
    def recorded_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            _record("write", path=os.path.abspath(os.fsdecode(f)), source=None)
        return save(obj, f, *args, **kwargs)

    module.save = recorded_save


class _AfterImport:
    """Changes a torch module right after it runs, before anything imports names from it."""
    changes = {"torch.distributed.distributed_c10d": _join_recorded,
               "torch.serialization": _save_recorded}

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        change = cls.changes.pop(name, None)
        if change is None:
            return None
        if not cls.changes:
            sys.meta_path.remove(cls)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            try:
                change(module)
            except Exception:
                pass

        spec.loader.exec_module = exec_module
        return spec


if _RECORDS:
    try:
        argv = list(getattr(sys, "orig_argv", sys.argv))
        agent = _is_agent(argv)
        _record("start", ppid=os.getppid(), argv=argv, cwd=os.getcwd(), agent=agent,
                pod=os.environ.get("SPIKE_REHEARSAL_POD"),
                env={k: v for k, v in os.environ.items() if k in _KEYS or k.startswith(("PET_", "SLURM_"))})
        if agent:
            _as_on_a_gpu_node()
        else:
            sys.meta_path.insert(0, _AfterImport)
        sys.addaudithook(_audit)
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
            signal.signal, signal.getsignal = _signal, (
                lambda signum, _get=signal.getsignal: _own_handler if signum == signal.SIGTERM else _get(signum))
        atexit.register(_record, "exit")
    except Exception:
        pass
