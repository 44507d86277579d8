"""python preemption_probe.py LOG SCRIPT ARGS...: run SCRIPT as ``__main__`` (as ``python
SCRIPT ARGS...`` would) and record its checkpoint saves; what the chapter 14 check's ranks run.

One JSON line per ``torch.distributed.checkpoint`` save in ``LOG/rank{R}.jsonl``:
the call (``save`` or ``async_save``), whether its process group is the default group and
whether it has a CPU backend (``async_save`` asserts that it has: on a GPU node the default
group is NCCL only), the device type the rank computes on, and whether the state handed to
the save holds this rank's CPU generator state and, on a GPU, its GPU generator state (dropout
and ``randn_like`` of a CUDA tensor draw from the GPU's; ``torch.get_rng_state()`` is the CPU's
only). So a check run on a laptop still names what would fail on a GPU node.

Standard library and torch only, and recording never changes what the script computes: the
save is handed the state it would have built itself (each ``Stateful``'s ``state_dict()``,
called once, here rather than inside the save).
"""

import json
import threading
import time
import os
import runpy
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver


def _tensors(value):
    """Every plain tensor in a (nested) state dict."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif type(value) is torch.Tensor:
        yield value


def _holds(state, generator_state) -> bool:
    return any(t.dtype == generator_state.dtype and t.shape == generator_state.shape
               and torch.equal(t.cpu(), generator_state) for t in _tensors(state))


def _reading(call, state, process_group) -> dict:
    group = process_group or dist.group.WORLD
    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"call": call,
            "time": time.time(),  # the drill tells periodic saves from those after its signal
            # async_save's upload calls save in a thread of its own: that save does not block training
            "main_thread": threading.current_thread() is threading.main_thread(),
            "default_group": group is dist.group.WORLD,
            "cpu_backend": torch.device("cpu") in group._device_types,
            "device": "cuda" if on_gpu else "cpu",
            "cpu_generator": _holds(state, torch.get_rng_state()),
            "gpu_generator": _holds(state, torch.cuda.get_rng_state(torch.cuda.current_device())) if on_gpu else None}


def _recorded(call, save, log):
    def wrapper(state_dict, *args, **kwargs):
        state = state_dict_saver._stateful_to_state_dict(state_dict)  # what the save would build first
        if dist.is_initialized() and not kwargs.get("no_dist"):
            try:
                reading = _reading(call, state, kwargs.get("process_group"))
            except Exception as error:  # recording must never break the learner's program
                reading = {"call": call, "unread": repr(error)}
            with open(log, "a") as out:
                out.write(json.dumps(reading) + "\n")
        return save(state, *args, **kwargs)
    return wrapper


def install(folder: str) -> None:
    log = os.path.join(folder, f"rank{os.environ['RANK']}.jsonl")
    save = _recorded("save", state_dict_saver.save, log)
    async_save = _recorded("async_save", state_dict_saver.async_save, log)
    for module in (dcp, state_dict_saver):  # `dcp.save` and `from ...state_dict_saver import save` alike
        module.save, module.async_save = save, async_save


def main() -> None:
    # The log folder is an argument, not an environment variable: the launcher keeps one warm
    # server per environment, and a new one would import torch again for every drill.
    log, script = sys.argv[1], os.path.abspath(sys.argv[2])
    sys.argv = [script, *sys.argv[3:]]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it: the script's own imports
    install(log)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
