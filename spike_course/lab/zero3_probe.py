"""python zero3_probe.py LOG STEPS SCRIPT ARGS...: run SCRIPT as ``__main__`` (as ``python SCRIPT
ARGS...`` would) and record, outside its reach, what its ranks did with the parameters; or
``python zero3_probe.py LOG STEPS --fsdp2 ARGS...``: train chapter 16's exercise model with
FSDP2 instead (the reference) and record the same digests. What the chapter 16 check's ranks run.

One JSON line per event in ``LOG/rank{R}.jsonl``:

* ``gather``: an all-gather, numbered ``n`` in issue order: its ``step``, whether it was
  ``async``, whether it was issued during a ``backward`` (by autograd), and the bytes that all
  the all-gathers' outputs held at that moment (``held``: their storage, freed or not);
* ``wait``: the handle of gather ``n`` was waited for;
* ``unwaited``: a module began its forward on parameters whose latest all-gather (``n``) had
  been issued with ``async_op=True`` and not yet waited for;
* ``stepped``: a digest of the optimizer's parameters (the shards) after step ``step``.

The last of the STEPS steps is traced (torch.profiler) into ``LOG/trace_rank{R}.json``. The
ranks run on the CPU with gloo, also on a GPU node. Standard library, torch,
``spike_course.runtime`` (the ranks' process group) and chapter 15's probe's digest only.
"""

import json
import os
import runpy
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import profile

from spike_course.lab.failures_probe import _digest


class _Arrival:
    """The script's handle of an all-gather, noting when it is waited for."""

    def __init__(self, work, probe, number):
        self.work, self.probe, self.number = work, probe, number

    def wait(self, *args, **kwargs):
        self.probe.waited.add(self.number)
        self.probe.write(event="wait", n=self.number)
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


class _Probe:
    def __init__(self, log: str, steps: int, trace: str):
        self.log, self.steps, self.trace = log, steps, trace
        self.step, self.outputs, self.gathers, self.waited, self.profiler = 0, {}, [], set(), None

    def write(self, **event) -> None:
        with open(self.log, "a") as out:  # a line at a time: a rank that crashes leaves what it did
            out.write(json.dumps({"step": self.step, **event}) + "\n")

    def held(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.outputs.values())

    def gather(self, original):
        def all_gather(output, input, *args, **kwargs):
            asynchronous = kwargs.get("async_op", args[1] if len(args) > 1 else False)
            number = len(self.gathers)
            self.outputs[id(output)] = output
            self.gathers.append((output.data_ptr(), output.untyped_storage().nbytes(), bool(asynchronous)))
            self.write(event="gather", n=number, bytes=output.untyped_storage().nbytes(), held=self.held(),
                       backward=torch._C._current_autograd_node() is not None, **{"async": bool(asynchronous)})
            work = original(output, input, *args, **kwargs)
            return _Arrival(work, self, number) if asynchronous else work
        return all_gather

    def before_forward(self, module, inputs) -> None:
        for p in module.parameters(recurse=False):
            latest = max((n for n, (start, size, _) in enumerate(self.gathers)
                          if size and start <= p.data_ptr() < start + size), default=None)
            if latest is not None and self.gathers[latest][2] and latest not in self.waited:
                self.write(event="unwaited", n=latest)

    def after_step(self, optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.write(event="stepped", digest=_digest(params))
        self.step += 1
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler.export_chrome_trace(self.trace)
            self.profiler = None
        elif self.step == self.steps - 1:  # the last step is traced
            self.profiler = profile()
            self.profiler.start()

    def after_reference_step(self, optimizer, args, kwargs) -> None:
        """FSDP2's local shards after a step, in the order the exercise's optimizer holds its own
        (unit by unit, each parameter's rows of this rank)."""
        self.write(event="stepped", digest=_digest([p.to_local() for g in optimizer.param_groups for p in g["params"]]))
        self.step += 1

    def install(self) -> None:
        for module in (dist, c10d):
            for name in ("all_gather_single", "all_gather_into_tensor"):
                setattr(module, name, self.gather(getattr(c10d, name)))
        register_module_forward_pre_hook(self.before_forward)
        register_optimizer_step_post_hook(self.after_step)


def fsdp2(args) -> None:
    """The reference: chapter 16's exercise model and batches, trained with FSDP2."""
    import argparse

    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    from spike_course import runtime

    parser = argparse.ArgumentParser()
    for name, default in (("--width", 128), ("--units", 4), ("--batch", 512), ("--steps", 3)):
        parser.add_argument(name, type=int, default=default)
    args = parser.parse_args(args)
    ctx = runtime.setup(device="cpu", seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, 2 * args.width), nn.Tanh(),
                                          nn.Linear(2 * args.width, args.width)) for _ in range(args.units)])
    torch.manual_seed(100 + ctx.rank)
    batches = [(torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)) for _ in range(args.steps)]
    model = model.to(ctx.device)
    for unit in model:
        fully_shard(unit)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        F.mse_loss(model(x.to(ctx.device)), y.to(ctx.device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    runtime.teardown()


def _on_the_cpu() -> None:
    """The script's ranks join with gloo on the CPU, even on a GPU node: the trace is then
    gloo's there too, its all-gathers on gloo's threads beside the compute on the main thread."""
    import functools

    from spike_course import runtime

    runtime.setup = functools.partial(runtime.setup, device="cpu")


def main() -> None:
    log, steps, script, *args = sys.argv[1:]
    rank = int(os.environ["RANK"])
    probe = _Probe(os.path.join(log, f"rank{rank}.jsonl"), int(steps), os.path.join(log, f"trace_rank{rank}.json"))
    if script == "--fsdp2":
        register_optimizer_step_post_hook(probe.after_reference_step)
        return fsdp2(args)
    probe.install()
    _on_the_cpu()
    script = os.path.abspath(script)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it: the script's own imports
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
