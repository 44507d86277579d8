"""What the capstone check's ranks record: this file becomes their ``sitecustomize.py``.

Every Python the check starts loads it (it sits on ``PYTHONPATH``), after the import
blocker that makes ``spike_course`` unimportable. In a rank (``RANK`` is set) it records,
one JSON line per event in ``$CAPSTONE_LOG/rank{R}_attempt{A}.jsonl``, what the learner's
script did, so that the check can judge behaviour and name a mistake:

- ``forward``: each forward of the model class ``$CAPSTONE_MODEL``, with the samples it
  was given (found by their pixels in ``$CAPSTONE_DATA``), grad mode and train mode;
- ``step``: each optimizer step, with its learning rate, whether the optimizer had state,
  and how many times DDP all-reduced gradients since the step before;
- ``save``, ``load``, ``open`` (for writing), ``rename``, ``init``, ``ddp``,
  ``destroy`` and ``exit``, with the paths, backend and devices the script chose.

``$CAPSTONE_CRASH`` ("rank:step") makes that rank fail once, after that many optimizer
steps of its first attempt (if it joined a process group), so that torchrun restarts the job. ``$CAPSTONE_SAVE_DELAY``
holds rank 0 inside each torch.save for that many seconds: a rank that goes on meanwhile
did not wait for the checkpoint. ``$CAPSTONE_FAKE_GPUS`` makes each node look as if it had
that many GPUs: the script's device, backend and DDP choices are recorded, the work stays
on the CPU, and the rank leaves as soon as the model is wrapped in DDP.

It needs the standard library and torch only (the ranks cannot import spike_course), and
recording never changes the script's arithmetic: DDP's all-reduce is counted by a comm hook
that does what DDP does without one (divide by the world size, then sum).
"""

import atexit
import builtins
import io
import json
import os
import sys
import time

if "RANK" in os.environ and "CAPSTONE_LOG" in os.environ:
    import torch
    import torch.distributed as dist
    # Before the script's init_process_group, as runtime.setup does: imported later, it keeps
    # the group alive past destroy_process_group and a finished rank's exit can abort.
    import torch.distributed.nn  # noqa: F401
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    RANK = int(os.environ["RANK"])
    FOLDER = os.environ["CAPSTONE_LOG"]

    def new_attempt():
        """This rank's attempt: how many processes held RANK before. (Not torchrun's restart
        count: an agent that restarts its workers because the other node restarted keeps 0.)"""
        attempt = 0
        while True:
            try:
                os.close(os.open(os.path.join(FOLDER, f"rank{RANK}_attempt{attempt}.jsonl"),
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                return attempt
            except FileExistsError:
                attempt += 1

    ATTEMPT = new_attempt()
    LOG = os.path.join(FOLDER, f"rank{RANK}_attempt{ATTEMPT}.jsonl")
    FAKE_GPUS = int(os.environ.get("CAPSTONE_FAKE_GPUS", 0))
    CRASH_RANK, CRASH_STEP = (int(x) for x in os.environ.get("CAPSTONE_CRASH", "-1:-1").split(":"))
    _open, _save, _load = builtins.open, torch.save, torch.load
    _state = {"syncs": 0, "steps": 0, "lines": 0, "weights_saved": False, "samples": None}

    def record(kind, **fields):
        with _open(LOG, "a") as out:
            out.write(json.dumps({"kind": kind, "time": time.time(), "rank": RANK, "attempt": ATTEMPT,
                                  "local_rank": int(os.environ.get("LOCAL_RANK", -1)), **fields}) + "\n")

    def recorded(function, describe):
        """``function``, recording ``describe(*args, **kwargs)`` before each call."""
        def wrapper(*args, **kwargs):
            try:
                kind, fields = describe(*args, **kwargs)
                record(kind, **fields)
            except Exception:  # recording must never break the learner's program
                pass
            return function(*args, **kwargs)
        return wrapper

    def path_of(f):
        return os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else None

    def sample_ids(images):
        """Which samples of the check's data (train first, then test) a batch holds."""
        if _state["samples"] is None:
            saved = _load(os.environ["CAPSTONE_DATA"])
            pixels = torch.cat([saved["train"][0], saved["test"][0]])
            _state["samples"] = ((pixels.float() / 255 - 0.1307) / 0.3081).flatten(1)
        rows = images.detach().float().cpu().flatten(1)
        return torch.cdist(rows, _state["samples"]).argmin(dim=1).tolist()

    def before_forward(module, args):
        if type(module).__name__ != os.environ.get("CAPSTONE_MODEL") or not args:
            return
        try:
            if not _state["weights_saved"]:  # the weights this attempt starts from
                _state["weights_saved"] = True
                _save({k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
                      os.path.join(FOLDER, f"weights_rank{RANK}_attempt{ATTEMPT}.pt"))
            record("forward", ids=sample_ids(args[0]), grad=torch.is_grad_enabled(),
                   training=module.training)
        except Exception as error:
            record("probe_error", error=repr(error))

    def before_step(optimizer, args, kwargs):
        _state["had_state"] = len(optimizer.state) > 0

    def after_step(optimizer, args, kwargs):
        _state["steps"] += 1
        record("step", lr=optimizer.param_groups[0]["lr"], had_state=_state["had_state"],
               syncs=_state["syncs"], lines=_state["lines"])
        _state["syncs"] = 0
        # Only a rank of a job: a lone process's crash would leave the other node waiting to restart.
        if RANK == CRASH_RANK and ATTEMPT == 0 and _state["steps"] == CRASH_STEP and dist.is_initialized():
            record("crash", step=CRASH_STEP)
            raise RuntimeError(f"the capstone check crashed rank {RANK} on purpose after {CRASH_STEP} "
                               "optimizer steps: torchrun should restart the job, which resumes")

    def counting_allreduce(process_group, bucket):
        if bucket.index() == 0:  # one count per all-reduce of the gradients, whatever the buckets
            _state["syncs"] += 1
        return default_hooks.allreduce_hook(process_group, bucket)

    class CountedLines(io.TextIOBase):
        """stdout, counting the lines this rank prints."""
        def __init__(self, stream):
            self.stream = stream

        def write(self, text):
            _state["lines"] += text.count("\n")
            return self.stream.write(text)

        def flush(self):
            self.stream.flush()

        def __getattr__(self, name):
            return getattr(self.stream, name)

    def writing(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            return "open", {"path": path_of(file), "mode": mode}
        raise LookupError  # not a write: record nothing

    def saving(obj, f, *args, **kwargs):
        start = time.time()
        _save(obj, f, *args, **kwargs)
        if RANK == 0:
            time.sleep(float(os.environ.get("CAPSTONE_SAVE_DELAY", 0)))
        record("save", path=path_of(f), start=start, keys=sorted(map(str, obj)) if isinstance(obj, dict) else None)

    def loading(f, *args, map_location=None, **kwargs):
        record("load", path=path_of(f), map_location=None if map_location is None else str(map_location))
        if FAKE_GPUS:
            map_location = "cpu"
        return _load(f, *args, map_location=map_location, **kwargs)

    def initialising(backend=None, *args, device_id=None, **kwargs):
        record("init", backend=backend, device_id=None if device_id is None else str(device_id))
        if FAKE_GPUS:  # the GPUs are pretend: the group runs on the CPU
            return _init("gloo", *args, **kwargs)
        return _init(backend, *args, device_id=device_id, **kwargs)

    _ddp_init = DistributedDataParallel.__init__

    def wrapping(self, module, device_ids=None, *args, **kwargs):
        listed = isinstance(device_ids, (list, tuple))
        record("ddp", device_ids=[str(d) for d in device_ids] if listed else
               None if device_ids is None else repr(device_ids))
        if FAKE_GPUS:  # what the script chose is recorded: the pretend run ends here
            os._exit(0)
        _ddp_init(self, module, device_ids, *args, **kwargs)
        self.register_comm_hook(None, counting_allreduce)

    torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)
    sys.stdout = CountedLines(sys.stdout)
    builtins.open = io.open = recorded(_open, writing)
    os.replace = recorded(os.replace, lambda src, dst, *a, **k: ("rename", {"src": path_of(src), "dst": path_of(dst)}))
    os.rename = recorded(os.rename, lambda src, dst, *a, **k: ("rename", {"src": path_of(src), "dst": path_of(dst)}))
    torch.save, torch.load = saving, loading
    _init = dist.init_process_group
    dist.init_process_group = initialising
    dist.destroy_process_group = recorded(dist.destroy_process_group, lambda *a, **k: ("destroy", {}))
    DistributedDataParallel.__init__ = wrapping
    atexit.register(lambda: record("exit", lines=_state["lines"]))

    if FAKE_GPUS:
        def device_index(device):
            device = torch.device(device) if isinstance(device, (str, int)) and device != "cpu" else device
            return device.index if isinstance(device, torch.device) and device.type == "cuda" else None

        def on_gpu(device):
            return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"

        def set_device(device):  # recorded, not refused: a refusal would leave the other rank waiting
            record("set_device", index=device if isinstance(device, int) else device_index(device))

        _module_to = torch.nn.Module.to

        def module_to(self, *args, **kwargs):
            device = kwargs.get("device", args[0] if args else None)
            if on_gpu(device):
                record("to", index=torch.device(device).index)
                return self
            return _module_to(self, *args, **kwargs)

        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: FAKE_GPUS
        torch.cuda.is_bf16_supported = lambda *a, **k: True
        torch.cuda.set_device = set_device
        torch.nn.Module.to = module_to
